"""Chat fine-tuning fixtures: small Hugging Face tokenizer directories with chat templates, and
JSONL conversations.

Each template marks its answers with {% generation %} blocks, so that transformers'
apply_chat_template(..., return_assistant_tokens_mask=True) gives an independent answer mask to
compare with (fmeg ignores the marks):
    chatml   Qwen2.5's shape: <|im_start|>role ... <|im_end|>
    llama3   Llama 3's: <|begin_of_text|>, headers, trimmed contents, <|eot_id|>
    qwen3
        Qwen3's thinking shape: answers after the last user turn open with an empty <think></think>,
        earlier
             answers do not (so a turn renders differently once later turns follow)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness.data_files import hf_tokenizer_dir

_ANSWER = "{% generation %}{{ ANSWER }}{% endgeneration %}"
TEMPLATES = {
    "chatml": "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ "
    "'<|im_start|>assistant\\n' }}"
    + _ANSWER.replace("ANSWER", "m['content'] + '<|im_end|>\\n'")
    + "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}{% if m['role'] == "
    "'assistant' %}"
    + _ANSWER.replace("ANSWER", "m['content'] | trim + '<|eot_id|>'")
    + "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% "
    "endif %}",
    "qwen3": "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% if m['role'] "
    "== 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% if loop.index0 > ns.last %}"
    + _ANSWER.replace(
        "ANSWER", "'<think>\\n\\n</think>\\n\\n' + m['content'].strip() + '<|im_end|>\\n'"
    )
    + "{% else %}"
    + _ANSWER.replace("ANSWER", "m['content'].strip() + '<|im_end|>\\n'")
    + "{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
}


def chat_tokenizer_dir(directory: Path, style: str, template: str | None = None) -> str:
    """A byte-level BPE tokenizer directory (test_hf_families.hf_tokenizer_dir: Llama 3's tokens for
    llama3, Qwen's otherwise) whose tokenizer_config.json carries the style's chat template (or
    `template`; "" for none)."""
    directory = Path(directory) / f"chat-{style}"
    directory.mkdir(parents=True, exist_ok=True)
    path = Path(hf_tokenizer_dir(directory, "llama3" if style == "llama3" else "qwen"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    chosen = TEMPLATES[style] if template is None else template
    if chosen:
        config["chat_template"] = chosen
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


WORDS = [
    "def",
    "f(x):",
    "return",
    "x",
    "*",
    "3",
    "the",
    "quick",
    "brown",
    "fox",
    "naïve",
    "✓",
    "\n",
    "  ",
]


def random_conversation(
    rng: random.Random, turns: int, words: int = 6, system: bool = True
) -> list[dict]:
    """An optional system turn, then `turns` user / assistant pairs of up to `words` random words
    each."""

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words))).strip() or "x"

    out = [{"role": "system", "content": text()}] if system else []
    for _ in range(turns):
        out += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return out


def write_jsonl(path: Path, lines: list[list[list[dict]]]) -> str:
    """A JSONL file of {"messages": ...} lines, each the concatenation of its conversations."""
    path.write_text(
        "".join(json.dumps({"messages": [m for c in line for m in c]}) + "\n" for line in lines)
    )
    return str(path)
