"""Megatron's SFTTokenizer: a Hugging Face tokenizer directory and a chat template, turning
conversations into token ids and the tokens a fine-tuned model is trained on.

    # the directory's own chat template
    tok = SFTTokenizer("hf_dir")
    tok = SFTTokenizer("hf_dir", "nemotron-h-aligned")             # one of Megatron's named formats
    # trained[i]: token i is part of an answer
    ids, trained = tok.tokenize_conversation(messages)
    # what a model answers (recipes.serve's chat)
    ids = tok.chat_prompt(messages)

ids are transformers' apply_chat_template(messages, tokenize=True) (the rendered text, no special
tokens added); trained marks each token that overlaps an assistant answer's span
(chat_template.assistant_spans), as transformers' return_assistant_tokens_mask marks {% generation
%} spans. encode, decode, vocab_size and eod are the directory's HuggingFaceTokenizer's; pad is the
format's pad token, else the directory's, else eod.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fmeg.data.chat_template import PROMPT_FORMATS, assistant_spans, template_renderer
from fmeg.data.tokenizers import HuggingFaceTokenizer

ROLES = ("system", "user", "assistant")


class SFTTokenizer(HuggingFaceTokenizer):
    def __init__(self, path: str, prompt_format: str | None = None):
        if not Path(path).is_dir():
            raise ValueError(
                f"--tokenizer-type SFTTokenizer --tokenizer-model {path}: expected a Hugging Face "
                "tokenizer directory (tokenizer.json, tokenizer_config.json)"
            )
        super().__init__(path)
        directory = Path(path)
        config = _json(directory / "tokenizer_config.json")
        self.prompt_format = None if prompt_format in (None, "default") else prompt_format
        if self.prompt_format is None:
            source, pad = _own_template(directory, config), _token_name(config.get("pad_token"))
        elif self.prompt_format in PROMPT_FORMATS:
            source, pad = PROMPT_FORMATS[self.prompt_format]
            if self._tok.token_to_id(pad) is None and self.prompt_format == "identity":
                pad = _token_name(config.get("pad_token"))
            elif self._tok.token_to_id(pad) is None:
                raise ValueError(
                    f"--sft-tokenizer-prompt-format {self.prompt_format} pads with {pad}, which "
                    f"--tokenizer-model {path} lacks; name a format of this tokenizer"
                )
        else:
            raise ValueError(
                f"--sft-tokenizer-prompt-format {prompt_format}: expected default (the tokenizer's "
                f"own chat template) or one of {', '.join(PROMPT_FORMATS)}"
            )
        specials = {
            name: _token_name(config.get(name))
            for name in (
                "bos_token",
                "eos_token",
                "unk_token",
                "pad_token",
                "sep_token",
                "cls_token",
                "mask_token",
            )
        }
        self._render = template_renderer(
            source, {k: v for k, v in specials.items() if v is not None}
        )
        pad_id = self._tok.token_to_id(pad) if pad else None
        self.pad = self.eod if pad_id is None else pad_id
        files = b"".join(
            (directory / name).read_bytes()
            for name in ("tokenizer.json", "tokenizer_config.json")
            if (directory / name).is_file()
        )
        self.fingerprint = hashlib.md5(files + source.encode() + str(self.pad).encode()).hexdigest()

    def tokenize_conversation(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """(ids of the rendered conversation, whether each is a token of an assistant answer).
        Raises chat_template.ChatTemplateError for a conversation the template refuses."""
        text, spans = assistant_spans(self._render, messages)
        encoding = self._tok.encode(text, add_special_tokens=False)
        trained, k = [], 0
        for begin, end in encoding.offsets:
            while k < len(spans) and spans[k][1] <= begin:
                k += 1
            trained.append(k < len(spans) and begin < spans[k][1] and end > spans[k][0])
        return list(encoding.ids), trained

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The ids a model answers: the conversation rendered with the template's generation prompt
        (transformers' apply_chat_template(messages, add_generation_prompt=True, tokenize=True)).
        ChatTemplateError as above."""
        return list(self._tok.encode(self._render(messages, True), add_special_tokens=False).ids)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer-model {path}: not readable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _own_template(directory: Path, config: dict) -> str:
    """The directory's chat template: tokenizer_config.json's chat_template (a string, or a list of
    named ones: "default"), else chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(
            (
                t.get("template")
                for t in template
                if isinstance(t, dict) and t.get("name") == "default"
            ),
            None,
        )
    if not template and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"--tokenizer-model {directory} has no chat template (tokenizer_config.json's "
            "chat_template or chat_template.jinja); add one, or name "
            f"--sft-tokenizer-prompt-format {' | '.join(PROMPT_FORMATS)}"
        )
    return template
