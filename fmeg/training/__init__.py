"""The training loop's pure parts: arguments, the parallel step, metrics."""
