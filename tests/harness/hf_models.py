"""Tiny Hugging Face checkpoints made by transformers itself, for the import and bad-file tests."""

from pathlib import Path

import torch


def tiny_llama(root: Path) -> None:
    """A 2-layer Llama (vocab 64, hidden 16, 4 heads over 2 kv heads) saved under root, seed 0."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root)
