"""Data: token sources and batch sampling (pure functions of a seed and a step)."""
