"""fmeg: Megatron-style GPT training as pure functions over parameter pytrees."""

__version__ = "0.1.0"
