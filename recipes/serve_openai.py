"""OpenAI's responses as recipes.serve shapes them: completions' logprobs and stream chunks, and
chat completions' answers and stream chunks.

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

from recipes.serve_api import Job


def openai_logprobs(
    tokenizer: Any,
    job: Job,
    prompt_ids: list[int],
    prompt_lps: list | None,
    prompt_top: list | None,
    row: Any,
    prompt_chars: int,
) -> dict:
    """OpenAI's legacy `choices[].logprobs` of a row (recipes.serve.Completion): each token's text,
    its logprob, the job's top_logprobs likeliest tokens ({text: logprob}, or None without logprobs
    N) and its character offset in the prompt + completion; with echo (prompt_lps given) the
    prompt's tokens come first, its first token's logprob and top null."""

    def top(pairs: list | None) -> dict | None:
        return None if pairs is None else {tokenizer.decode([i]): lp for i, lp in pairs}

    ids, lps, tops = (
        list(row.ids),
        list(row.logprobs),
        [top(t) for t in row.top] if job.top_logprobs else [None] * len(row.ids),
    )
    if prompt_lps is not None:
        prompt_tops = (
            [None] + [top(t) for t in prompt_top] if prompt_top else [None] * len(prompt_ids)
        )
        ids, lps, tops = prompt_ids + ids, [None] + prompt_lps + lps, prompt_tops + tops
    pieces = [tokenizer.decode([t]) for t in ids]
    offsets, at = [], 0 if prompt_lps is not None else prompt_chars
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": lps,
        "top_logprobs": tops if job.top_logprobs else None,
        "text_offset": offsets,
    }


def openai_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


class CompletionChunks:
    """The chunks of a streamed completion: the prompt first with echo, then each step's text and
    logprobs."""

    def __init__(self, head: dict, tokenizer: Any, job: Job, prompt: str):
        self.head, self.tokenizer, self.job, self.prompt = head, tokenizer, job, prompt

    def chunk(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        # with include_usage every chunk carries "usage": null, as OpenAI's do
        return {
            **self.head,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
            **({"usage": None} if self.job.usage_chunk else {}),
        }

    def opening(self) -> list[dict]:
        return [self.chunk(self.prompt, None)] if self.job.echo else []

    def step(
        self, piece: str, finish: str | None, token: int, logprob: float, top: list | None
    ) -> list[dict]:
        decode = self.tokenizer.decode
        lp = (
            {
                "tokens": [decode([token])],
                "token_logprobs": [logprob],
                "top_logprobs": [{decode([i]): v for i, v in top}] if top else None,
                "text_offset": None,
            }
            if self.job.logprobs
            else None
        )
        return [self.chunk(piece, finish, lp)] if piece or finish or lp else []


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
