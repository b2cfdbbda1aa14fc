"""The two request formats recipes.serve speaks, as pure functions: a JSON body -> a Job, or a
reason.

Megatron's `PUT /api` (tools/run_text_generation_server.py):
    {"prompts": ["..."], "tokens_to_generate": 64, "temperature": 1.0, "top_k": 0, "top_p": 0.0,
     "logprobs": false, "random_seed": -1, "add_BOS": false, "stop_on_eol": false,
         "stop_on_double_eol": false,
     "stop_token": <eod>, "no_log": false}
    -> {"text": [prompt + completion], "tokens": [prompt ids + new ids], "segments": [[piece per
        token]],
        "logprobs": [[prompt logprobs (from the second token) + new logprobs]]}
            (logprobs when asked)
    a bad request: HTTP 400 {"message": reason}, which Megatron's tools/text_generation_cli.py
        prints
OpenAI's `POST /v1/chat/completions`:
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..." | [{"type": "text",
        "text": ...}]}],
     "max_completion_tokens" | "max_tokens": the rest of the context, "temperature", "top_p",
         "stop",
     "logprobs": false, "top_logprobs": 0..20, "seed", "stream", "stream_options", "n": 1, ...}
    the messages rendered by the model's chat template (with the generation prompt, as --sft renders
        them),
    then run as a completion of those token ids
OpenAI's `POST /v1/completions`:
    {"prompt": "..." | ["..."] | [ids] | [[ids]], "max_tokens": 16, "temperature": 1.0, "top_p":
        1.0,
     "stop": "..." | [...], "logprobs": null | 0..20, "echo": false, "seed": null, "stream": false,
         "n": 1, ...}
    -> choices[i].logprobs {"tokens", "token_logprobs", "top_logprobs", "text_offset"} over the
        prompt too with
       echo (its first token's logprob and top_logprobs null); max_tokens 0 with echo scores the
           prompt alone,
       as lm-evaluation-harness's local-completions asks for loglikelihoods

A field the format does not define, or one fmeg does not implement (beam search, top-p decay,
penalties), is refused with its name, so a request is never half-honoured. Every value is checked
here, before anything reaches a rank: integers within the range the code uses (seeds from 0 to 2**63
- 1, as torch's int64 generators take them; larger ones are refused, not wrapped), numbers finite,
prompts text that UTF-8 can encode. OpenAI's null for an optional field means its default. Prompt
length and vocabulary checks need the tokenizer and the model: recipes.serve.plan does them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from fmeg.inference import SamplingParams

MAX_PROMPTS = 128
MAX_SEED = 2**63 - 1
# far above any model's positions: plan() then says how many fit
MAX_TOKENS = 2**31 - 1
# OpenAI's legacy completions allowed 5; evaluation harnesses ask for 1
MAX_LOGPROBS = 20


class BadRequest(ValueError):
    """A request the server answers with HTTP 400 and this one-line message."""


class ModelNotFound(BadRequest):
    """A request naming a model other than the one served: OpenAI's HTTP 404, code
    model_not_found."""


def check_model(body: dict, served: str) -> None:
    """An OpenAI request's "model", when given (null or left out: the served one), must be the id
    GET /v1/models lists: a client asking for another model must not get this one's answer."""
    model = body.get("model")
    if model is None or model == served:
        return
    _check(isinstance(model, str), f"model must be a string (this server serves {served!r})")
    raise ModelNotFound(
        f"The model {model!r} does not exist here: this server serves {served!r} (the id GET "
        "/v1/models lists)"
    )


@dataclass
class Job:
    """One generation for every rank: what to run, independent of the API that asked."""

    prompts: list[str]
    max_new_tokens: int
    sampling: SamplingParams
    # None: a fresh seed per request
    seed: int | None = None
    logprobs: bool = False
    stop: list[str] = field(default_factory=list)
    # None: the tokenizer's end of document
    stop_token: int | None = None
    add_bos: bool = False
    echo: bool = False
    stream: bool = False
    log: bool = True
    # OpenAI's stream_options.include_usage: a last chunk with the usage
    usage_chunk: bool = False
    # OpenAI's logprobs N: the N likeliest tokens at each position
    top_logprobs: int = 0


def parse_json(body: bytes) -> dict:
    try:
        value = json.loads(body or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadRequest("the request body must be a JSON object")
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_text(prompts: list[str], name: str) -> None:
    """Each prompt encodes as UTF-8 (JSON allows lone surrogates such as "\\ud800", which no
    tokenizer reads)."""
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(
                f"{name}[{i}] is not valid text: it holds {text[e.start : e.end]!r} (a lone "
                f"surrogate) at {e.start}; send UTF-8 text"
            ) from None


def _unknown(body: dict, known: set[str], unsupported: dict[str, str]) -> None:
    for name in body:
        if name in unsupported:
            raise BadRequest(f"{name}: {unsupported[name]}")
        _check(name in known, f"unknown field {name!r}; expected one of {', '.join(sorted(known))}")


MEGATRON_FIELDS = {
    "prompts",
    "tokens_to_generate",
    "temperature",
    "top_k",
    "top_p",
    "logprobs",
    "random_seed",
    "add_BOS",
    "stop_on_eol",
    "stop_on_double_eol",
    "stop_token",
    "no_log",
}
MEGATRON_UNSUPPORTED = {
    "beam_width": "beam search is not implemented in fmeg; leave it out",
    "length_penalty": "only used by beam search, which fmeg does not implement; leave it out",
    "top_p_decay": "not implemented in fmeg; leave it out",
    "top_p_bound": "not implemented in fmeg; leave it out",
    "prevent_newline_after_colon": "not implemented in fmeg; leave it out",
    "max_len": "max_len is no longer used; replace it with tokens_to_generate",
    "sentences": "sentences is no longer used; replace it with prompts",
}


def megatron_job(body: dict) -> Job:
    """A Megatron `PUT /api` request, checked as Megatron checks it."""
    _unknown(body, MEGATRON_FIELDS, MEGATRON_UNSUPPORTED)
    _check("prompts" in body, "prompts argument required")
    prompts = body["prompts"]
    _check(
        isinstance(prompts, list) and all(isinstance(p, str) for p in prompts),
        "prompts is not a list of strings",
    )
    _check(len(prompts) > 0, "prompts is empty")
    _check(len(prompts) <= MAX_PROMPTS, f"Maximum number of prompts is {MAX_PROMPTS}")
    _check_text(prompts, "prompts")
    tokens = body.get("tokens_to_generate", 64)
    _check(
        _is_int(tokens) and 0 <= tokens <= MAX_TOKENS,
        "tokens_to_generate must be an integer greater than or equal to 0",
    )
    logprobs = body.get("logprobs", False)
    _check(isinstance(logprobs, bool), "logprobs must be a boolean value")
    _check(tokens > 0 or logprobs, "tokens_to_generate=0 implies logprobs should be True")
    temperature = body.get("temperature", 1.0)
    _check(
        _is_number(temperature) and 0.0 < temperature <= 100.0,
        "temperature must be a positive number less than or equal to 100.0",
    )
    top_k = body.get("top_k", 0)
    _check(_is_int(top_k) and 0 <= top_k <= 1000, "top_k must be an integer from 0 to 1000")
    top_p = body.get("top_p", 0.0)
    _check(_is_number(top_p) and 0.0 <= top_p <= 1.0, "top_p must be a number from 0 to 1.0")
    _check(not (top_p > 0.0 and top_k > 0), "cannot set both top-k and top-p samplings.")
    seed = body.get("random_seed", -1)
    _check(
        _is_int(seed) and -1 <= seed <= MAX_SEED,
        "random_seed must be an integer from 0 to 2**63 - 1 (or -1 for a fresh one)",
    )
    flags = {}
    for name in ("add_BOS", "stop_on_eol", "stop_on_double_eol", "no_log"):
        flags[name] = body.get(name, False)
        _check(isinstance(flags[name], bool), f"{name} must be a boolean value")
    _check(flags["add_BOS"] or all(prompts), "Empty prompts require add_BOS=true")
    stop_token = body.get("stop_token")
    _check(
        stop_token is None or (_is_int(stop_token) and 0 <= stop_token <= MAX_TOKENS),
        "stop_token must be a token id (a non-negative integer)",
    )
    stop = ["\n\n"] if flags["stop_on_double_eol"] else ["\n"] if flags["stop_on_eol"] else []
    return Job(
        prompts,
        tokens,
        SamplingParams(float(temperature), top_k, float(top_p)),
        None if seed == -1 else seed,
        logprobs,
        stop,
        stop_token,
        flags["add_BOS"],
        echo=True,
        log=not flags["no_log"],
    )


OPENAI_FIELDS = {
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "logprobs",
    "echo",
    "seed",
    "stream",
    "n",
    "best_of",
    "model",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream_options",
}
OPENAI_UNSUPPORTED = {"suffix": "insertion (suffix) is not implemented in fmeg; leave it out"}


def _openai_prompts(body: dict) -> list:
    """The request's prompts: strings or lists of token ids, checked."""
    _check("prompt" in body, "prompt is required")
    prompt = body["prompt"]
    # one prompt of token ids
    ids = isinstance(prompt, list) and bool(prompt) and all(_is_int(t) for t in prompt)
    prompts = [prompt] if isinstance(prompt, str) or ids else prompt
    _check(
        isinstance(prompts, list)
        and all(
            isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p))
            for p in prompts
        ),
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        "them",
    )
    _check(0 < len(prompts) <= MAX_PROMPTS, f"prompt must hold 1 to {MAX_PROMPTS} prompts")
    _check(all(prompts), "prompt is empty; give at least one character or token id")
    _check_text([p for p in prompts if isinstance(p, str)], "prompt")
    return prompts


def _openai_sampling(body: dict) -> tuple:
    """(max_tokens, temperature, top_p, top_k) of the request, checked."""
    tokens = body.get("max_tokens", 16)
    _check(
        _is_int(tokens) and 0 <= tokens <= MAX_TOKENS,
        "max_tokens must be an integer greater than or equal to 0",
    )
    temperature = body.get("temperature", 1.0)
    _check(
        _is_number(temperature) and 0.0 <= temperature <= 2.0,
        "temperature must be a number from 0 to 2",
    )
    top_p = body.get("top_p", 1.0)
    _check(_is_number(top_p) and 0.0 < top_p <= 1.0, "top_p must be a number in (0, 1]")
    top_k = body.get("top_k", 0)
    _check(_is_int(top_k) and 0 <= top_k <= MAX_TOKENS, "top_k must be an integer >= 0 (0: no cut)")
    return tokens, temperature, top_p, top_k


def openai_job(body: dict) -> Job:
    """An OpenAI `POST /v1/completions` request (null for an optional field is its default)."""
    body = {k: v for k, v in body.items() if v is not None}
    _unknown(body, OPENAI_FIELDS, OPENAI_UNSUPPORTED)
    prompts = _openai_prompts(body)
    tokens, temperature, top_p, top_k = _openai_sampling(body)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    _check(
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop),
        "stop must be a non-empty string or a list of up to 4 of them",
    )
    _check_text(stop, "stop")
    logprobs = body.get("logprobs")
    _check(
        logprobs is None or (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS),
        f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the likeliest tokens listed per "
        "position), or null",
    )
    for name, ok, why in (
        ("n", 1, "only n=1 is implemented"),
        ("best_of", 1, "only best_of=1 is implemented"),
        ("presence_penalty", 0, "penalties are not implemented; give 0 or leave it out"),
        ("frequency_penalty", 0, "penalties are not implemented; give 0 or leave it out"),
    ):
        _check(
            body.get(name, ok) == ok and not isinstance(body.get(name, ok), bool), f"{name}: {why}"
        )
    _check(not body.get("logit_bias"), "logit_bias: not implemented; leave it out")
    seed = body.get("seed")
    _check(
        seed is None or (_is_int(seed) and 0 <= seed <= MAX_SEED),
        "seed must be an integer from 0 to 2**63 - 1",
    )
    flags = {name: body.get(name, False) for name in ("echo", "stream")}
    for name, value in flags.items():
        _check(isinstance(value, bool), f"{name} must be a boolean")
    _check(not (flags["stream"] and len(prompts) > 1), "stream: one prompt at a time")
    options = body.get("stream_options", {})
    _check(
        isinstance(options, dict)
        and set(options) <= {"include_usage"}
        and isinstance(options.get("include_usage", False), bool),
        "stream_options must be an object with include_usage true or false",
    )
    _check(not options or flags["stream"], "stream_options is only allowed with stream: true")
    return Job(
        prompts,
        tokens,
        SamplingParams(float(temperature), top_k, 0.0 if top_p == 1.0 else float(top_p)),
        seed,
        logprobs is not None,
        stop,
        echo=flags["echo"],
        stream=flags["stream"],
        usage_chunk=options.get("include_usage", False),
        top_logprobs=logprobs or 0,
    )


CHAT_FIELDS = {
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "logprobs",
    "top_logprobs",
    "seed",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
_NO_TOOLS = "tool and function calling is not implemented in fmeg; leave it out"
CHAT_UNSUPPORTED = {
    "tools": _NO_TOOLS,
    "tool_choice": _NO_TOOLS,
    "functions": _NO_TOOLS,
    "function_call": _NO_TOOLS,
    "parallel_tool_calls": _NO_TOOLS,
    "response_format": "structured outputs are not implemented in fmeg; leave it out",
    "audio": "fmeg's models read and write text only",
    "modalities": "fmeg's models are text only",
    "prediction": "predicted outputs are not implemented in fmeg; leave it out",
}
CHAT_ROLES = ("system", "developer", "user", "assistant")


def _message(i: int, m: Any) -> dict:
    """One chat message as the chat template takes it: its role and its text (text parts joined)."""
    _check(isinstance(m, dict), f"messages[{i}] must be an object with a role and a content")
    _check(
        set(m) <= {"role", "content", "name"},
        f"messages[{i}] holds {sorted(set(m) - {'role', 'content', 'name'})}; fmeg takes role, "
        "content and name",
    )
    role, content = m.get("role"), m.get("content")
    _check(
        role in CHAT_ROLES,
        f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
    )
    if isinstance(content, list):
        _check(
            all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ),
            f'messages[{i}].content parts must be {{"type": "text", "text": ...}}',
        )
        content = "".join(p["text"] for p in content)
    _check(
        isinstance(content, str), f"messages[{i}].content must be a string or a list of text parts"
    )
    _check_text([content], f"messages[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": content}


def chat_job(body: dict, render: Callable[[list[dict]], list[int]], context: int) -> Job:
    """An OpenAI `POST /v1/chat/completions` request: its messages rendered to token ids by render
    (the chat template with the generation prompt; a ValueError of it is the request's problem),
    then checked and run as a completion of them (openai_job), with at most the rest of the model's
    context positions to generate."""
    body = {k: v for k, v in body.items() if v is not None}
    _unknown(body, CHAT_FIELDS, CHAT_UNSUPPORTED)
    _check("messages" in body, "messages is required")
    messages = body["messages"]
    _check(
        isinstance(messages, list) and 0 < len(messages),
        "messages must be a non-empty list of messages",
    )
    messages = [_message(i, m) for i, m in enumerate(messages)]
    logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
    _check(isinstance(logprobs, bool), "logprobs must be a boolean")
    _check(
        top is None or (_is_int(top) and 0 <= top <= MAX_LOGPROBS and logprobs),
        f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, with logprobs: true",
    )
    try:
        ids = render(messages)
    except ValueError as e:
        raise BadRequest(
            f"messages: the model's chat template refuses them ({' '.join(str(e).split())[:200]})"
        )
    _check(
        len(ids) < context,
        f"messages are {len(ids)} tokens, which leaves none of the model's {context} positions to "
        "answer in",
    )
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    tokens = body.get(name, context - len(ids))
    # the bound that matters here: the rest of the model's positions (openai_job's 2**31 - 1 is
    # for prompts it has not seen yet)
    _check(
        not _is_int(tokens) or tokens <= context - len(ids),
        f"{name} {tokens} exceeds the model's {context} positions less the messages' {len(ids)} "
        f"tokens: ask for at most {context - len(ids)}",
    )
    passed = {
        k: body[k]
        for k in CHAT_FIELDS
        - {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}
        if k in body
    }
    return openai_job(
        {
            **passed,
            "prompt": ids,
            "max_tokens": tokens,
            "logprobs": (top or 0) if logprobs else None,
        }
    )
