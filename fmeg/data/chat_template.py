"""Chat templates: a conversation rendered to text as transformers' apply_chat_template renders it,
and the character spans of its assistant answers (what supervised fine-tuning trains on).

    render = template_renderer(template_source, {"eos_token": "<|im_end|>", ...})
    text, spans = assistant_spans(render, messages)     # spans: [(start, end)] characters of text

An answer's span starts after the generation prompt that precedes it (render(messages[:k],
add_generation_prompt=True)) and ends where the template closes its turn, end-of-turn token
included, so a model learns to stop. Templates that render earlier turns differently once later ones
follow (Qwen3 drops earlier answers' empty thinking blocks) are handled by rendering a stand-in
answer: the text after it locates the answer's end, and the turn's closing text is what follows it
when the turn is the last; a template whose renderings cannot be lined up so is refused with
ChatTemplateError.

Rendering needs jinja2 (pip install jinja2, or transformers, which brings it); the environment is
transformers' (a sandbox with trim_blocks, lstrip_blocks, loop controls, raise_exception,
strftime_now, a tojson that keeps non-ASCII text); {% generation %} blocks render their body.
"""

from __future__ import annotations

import datetime
import json
from typing import Callable

Renderer = Callable[[list, bool], str]


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or whose answers cannot be found in the
    rendering."""


def template_renderer(source: str, special_tokens: dict[str, str]) -> Renderer:
    """render(messages, add_generation_prompt) -> text of the jinja template source, given the
    tokenizer's special tokens by name (bos_token, eos_token, ...) as transformers passes them."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ValueError("--sft chat templates need jinja2: pip install jinja2") from e

    # transformers marks trained spans with {% generation %}; here it renders its body
    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = (
        lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not parse ({e})") from None

    def render(messages: list, add_generation_prompt: bool) -> str:
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refuses it ({e})") from None

    return render


def assistant_spans(render: Renderer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the [start, end) characters of each assistant turn's answer and end
    of turn)."""
    text = render(messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:k], True)
        if not text.startswith(prompt):
            raise ChatTemplateError(
                f"turn {k + 1}: the template renders the turns before it differently once it "
                "follows, so its answer cannot be found; name a --sft-tokenizer-prompt-format"
            )
        start = len(prompt)
        alone = render(messages[: k + 1], False)
        end = len(alone) if text.startswith(alone) else _moved_turn_end(render, messages, k, text)
        if end is None:
            raise ChatTemplateError(
                f"turn {k + 1}: the template renders this answer differently when later turns "
                "follow, and its end was not found; name a --sft-tokenizer-prompt-format"
            )
        spans.append((start, end))
    return text, spans


# private-use characters: no template strips or rewrites them
_STAND_IN = "\ue000fmeg-answer\ue001"


def _moved_turn_end(render: Renderer, messages: list[dict], k: int, text: str) -> int | None:
    """Where assistant turn k, which the template renders differently when it is the last turn, ends
    in text: its answer ends where the rendering with a stand-in answer has the same text after the
    stand-in, and its closing text is what follows the stand-in when the turn is the last."""
    stand_in = [*messages[:k], {**messages[k], "content": _STAND_IN}]
    whole = render(stand_in + messages[k + 1 :], False)
    alone = render(stand_in, False)
    if whole.count(_STAND_IN) != 1 or alone.count(_STAND_IN) != 1:
        return None
    after = whole[whole.index(_STAND_IN) + len(_STAND_IN) :]
    closing = alone[alone.index(_STAND_IN) + len(_STAND_IN) :]
    answer_end = len(text) - len(after)
    if not text.endswith(after) or not text.startswith(closing, answer_end):
        return None
    return answer_end + len(closing)


# Megatron's named prompt formats (--sft-tokenizer-prompt-format), written here as templates that
# give the same text, with the generation prompt each answer follows: {name: (template, pad token)}.
PROMPT_FORMATS = {
    "nemotron-h-aligned": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + "
        "m['content'].strip() + '\n' }}{% elif m['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + "
        "m['content'].strip() + '\n<SPECIAL_11>Assistant\n' }}{% elif m['role'] == 'assistant' "
        "%}{{ m['content'].strip() + '\n' }}{% endif %}{% endfor %}",
        "<SPECIAL_233>",
    ),
    "nemotron-nano-v2": (
        "{% for m in messages %}{% set c = m['content'].replace('/think', "
        "'').replace('/no_think', '') %}{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + "
        "c.strip() + '\n' }}{% elif m['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + c.strip() + "
        "'\n' }}{% elif m['role'] == 'assistant' %}{{ '<SPECIAL_11>Assistant\n' + "
        "m['content'].strip() + '\n<SPECIAL_12>\n' }}{% endif %}{% endfor %}{% if "
        "add_generation_prompt %}{{ '<SPECIAL_11>Assistant\n' }}{% endif %}",
        "<unk>",
    ),
    # each turn's text as it is, nothing between turns; the answers trained on (pad: <unk>, else the
    # directory's)
    "identity": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "<unk>"),
}
