"""OpenAI's chat completions as recipes.serve answers them: a finished answer, and the chunks of a
streamed one.

    POST /v1/chat/completions {"messages": [...], "stream": false}
    -> {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": text},
        "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} | null,
        "finish_reason"}],
        "usage": {...}}
    with "stream": true, server-sent events of "chat.completion.chunk"s: the role first, then the
    text as it grows (each with its tokens' logprobs when asked), then the finish reason, then
    [DONE]

The end-of-turn token ends the answer (finish_reason "stop") and is not part of its text or its
logprobs.
"""

from __future__ import annotations

from typing import Any


def has_template(tokenizer: Any) -> bool:
    """Whether the tokenizer renders conversations (SFTTokenizer: the directory's chat template)."""
    return callable(getattr(tokenizer, "chat_prompt", None))


def token_logprob(tokenizer: Any, token: int, logprob: float, top: list | None) -> dict:
    """One token of OpenAI's chat logprobs: its text, logprob, UTF-8 bytes and the likeliest tokens
    there."""
    text = tokenizer.decode([token])
    alternatives = [
        {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode())}
        for i, lp in top or ()
    ]
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode()),
        "top_logprobs": alternatives,
    }


def answer(
    head: dict, tokenizer: Any, row: Any, eod: int, logprobs: bool, prompt_tokens: int, reason: str
) -> dict:
    """The chat.completion of one finished row (recipes.serve.Completion)."""
    content = None
    if logprobs:
        content = [
            token_logprob(tokenizer, t, lp, top)
            for t, lp, top in zip(row.ids, row.logprobs, row.top)
            if t != eod
        ]
    made = len(row.ids)
    return {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": row.final_text},
                "logprobs": None if content is None else {"content": content},
                "finish_reason": reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": made,
            "total_tokens": prompt_tokens + made,
        },
    }


class ChatChunks:
    """The chunks of a streamed chat completion, step by step (recipes.serve's sse drives it)."""

    def __init__(self, head: dict, tokenizer: Any, eod: int, logprobs: bool, usage: bool):
        self.head = {**head, "object": "chat.completion.chunk"}
        self.tokenizer, self.eod, self.logprobs, self.usage = tokenizer, eod, logprobs, usage

    def chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        # with include_usage every chunk carries "usage": null, as OpenAI's do
        return {
            **self.head,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
            **({"usage": None} if self.usage else {}),
        }

    def opening(self) -> list[dict]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def step(
        self, piece: str, finish: str | None, token: int, logprob: float, top: list | None
    ) -> list[dict]:
        out = []
        lp = (
            {"content": [token_logprob(self.tokenizer, token, logprob, top)]}
            if self.logprobs and token != self.eod
            else None
        )
        if piece or lp:
            out.append(self.chunk({"content": piece}, None, lp))
        if finish:
            out.append(self.chunk({}, finish))
        return out
