"""A tiny, random Qwen3 chat model directory and a JSONL file of conversations to fine-tune it on
(docs/fine-tuning.md's example; no download).

    python -m recipes.tiny_chat_model --output qwen3_chat --conversations chat.jsonl

The model directory holds a transformers Qwen3ForCausalLM (random weights) and its tokenizer: bytes
plus Qwen's chat tokens (<|endoftext|> ends a document, <|im_start|> / <|im_end|> frame the turns),
with a ChatML chat template in tokenizer_config.json. The conversations ask for the capitals of a
few countries, one or two questions a line, some with a system turn.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Cuba": "Havana",
    "Nepal": "Kathmandu",
}
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory: Path) -> int:
    """A byte-level tokenizer (256 bytes, then the chat tokens) with the chat template; its
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    return tok.get_vocab_size()


def conversations(rng: random.Random, lines: int) -> list[dict]:
    out = []
    for _ in range(lines):
        messages = (
            [{"role": "system", "content": "Answer in one word."}] if rng.random() < 0.5 else []
        )
        for country in rng.sample(sorted(CAPITALS), rng.randint(1, 2)):
            messages += [
                {"role": "user", "content": f"What is the capital of {country}?"},
                {"role": "assistant", "content": CAPITALS[country] + "."},
            ]
        out.append({"messages": messages})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", required=True, help="the model directory to write")
    p.add_argument("--conversations", required=True, help="the JSONL file to write")
    p.add_argument("--lines", type=int, default=2000)
    a = p.parse_args(argv)
    import torch
    import transformers

    from fmeg.interop import quiet_torchao

    # building the model imports torchao (through transformers), whose import logs four lines
    quiet_torchao()
    directory = Path(a.output)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory)
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=vocab - 1,
    )
    # the same weights every run: the fine-tuned answers tests compare are then reproducible
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    Path(a.conversations).write_text(
        "".join(json.dumps(c) + "\n" for c in conversations(random.Random(0), a.lines))
    )
    print(
        f"wrote {directory} (Qwen3ForCausalLM, {vocab} tokens, a ChatML template) and "
        f"{a.conversations}"
    )


if __name__ == "__main__":
    main()
