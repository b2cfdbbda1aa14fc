"""Autoregressive generation for a batch of prompts, on one rank or one rank of a tp x pp layout.

    for step in stream(params, prompts, config, max_new_tokens=32): ...    # one Step per new token
    result = generate(params, prompts, config, max_new_tokens=32,
        sampling=SamplingParams(temperature=0))

Sharding contract: params are this rank's stage (gpt_pipeline.split with pp stages, one per pipeline
rank, then its tensor-parallel shard); tp and pp_group are this rank's groups. Every rank of the
layout calls with the same prompts and settings. Stage 0 embeds, each stage sends its hidden states
on, the last stage samples, and the new ids travel back to every stage (one all-reduce over the
pipeline group), so every rank yields the same Steps and stops at the same step.

Prompts of different lengths are left-padded in one cache; each row's result equals its own
unbatched generation. A row stops at the end-of-document id (eod), when stop(row, ids so far) says
so, or after max_new_tokens; the batch stops when every row has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from fmeg.inference.cached_forward import stage_forward
from fmeg.inference.kv_cache import new_cache
from fmeg.inference.sampling import SamplingParams, sample, token_logprobs
from fmeg.models.gpt import GPTConfig, Params
from fmeg.ops.random import fold_in
from fmeg.parallel.tensor import NO_TP, TensorParallel


@dataclass(frozen=True)
class Step:
    # the new id of each row; None for a row that had already finished
    ids: list[int | None]
    logprobs: list[float | None]
    # per row: None while running, else "eod", "stop" or "length"
    finished: list[str | None]
    # per row, with top_logprobs: the N likeliest ids
    top: list[list[tuple[int, float]] | None] | None = None


@dataclass
class Generation:
    # generated ids per row (the eod id included)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # per row, for prompt tokens 1 .. n-1
    prompt_logprobs: list[list[float]] | None = None


def check_prompts(prompts: list[list[int]], config: GPTConfig, max_new_tokens: int) -> None:
    """ValueError with the reason for prompts this model cannot continue."""
    if not prompts:
        raise ValueError("no prompts")
    if max_new_tokens < 0:
        raise ValueError(f"the number of tokens to generate must be >= 0, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        if min(p) < 0 or max(p) >= config.vocab_size:
            raise ValueError(
                f"prompt {i} has a token id outside the vocabulary [0, {config.vocab_size})"
            )
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new exceeds the model's "
            f"{config.max_seq_len} positions"
        )


class _Pipeline:
    """This rank's stage: runs it, passes activations on, and shares the last stage's results."""

    def __init__(self, params: Params, config: GPTConfig, tp: TensorParallel, group: Any):
        self.params, self.config, self.tp, self.group = params, config, tp, group
        self.rank, self.size = (0, 1) if group is None else (group.rank, group.size)

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def forward(self, tokens: torch.Tensor, cache, last_only: bool):
        x = None if self.rank == 0 else self.group.recv(self.rank - 1)
        out, cache = stage_forward(
            self.params,
            tokens,
            x,
            cache,
            self.config,
            final=self.last,
            tp=self.tp,
            last_only=last_only,
            first_layer=self.rank * len(self.params["layers"]),
        )
        if not self.last:
            self.group.send(out, self.rank + 1)
            self.group.finish()
            return None, cache
        return out, cache

    def share(self, values: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The last stage's values on every stage (float64 carries ids exactly)."""
        if self.group is None:
            return values
        return self.group.all_reduce(
            values.double() if self.last else torch.zeros_like(like, dtype=torch.float64)
        )


def stream(
    params: Params,
    prompts: list[list[int]],
    config: GPTConfig,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int | list[int] = 0,
    eod: int | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
    tp: TensorParallel = NO_TP,
    pp_group: Any = None,
    prompt_logprobs: list | None = None,
    top_logprobs: int = 0,
    prompt_top_logprobs: list | None = None,
) -> Iterator[Step]:
    """Yields one Step per generated position until every row has finished. seed: one for all rows
    or one per row (a row's draws depend on its own seed only). prompt_logprobs: a list that
    receives, before the first Step, each row's prompt-token logprobs. top_logprobs N: each Step's
    `top` holds each row's N likeliest (id, logprob) pairs, and prompt_top_logprobs (a list)
    receives them for each prompt position 1 .. n-1."""
    check_prompts(prompts, config, max_new_tokens)
    if max_new_tokens == 0 and prompt_logprobs is None:
        return
    stage = _Pipeline(params, config, tp, pp_group)
    device = next(t for t in torch.utils._pytree.tree_leaves(params)).device
    b, longest = len(prompts), max(len(p) for p in prompts)
    seeds = torch.tensor(
        seed if isinstance(seed, list) else [seed] * b, dtype=torch.int64, device=device
    )
    pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.int64)
    tokens = torch.tensor(
        [[0] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.int64, device=device
    )
    cache = new_cache(params, config, batch=b, capacity=longest + max_new_tokens, pad=pad)
    with torch.no_grad():
        logits, cache = stage.forward(tokens, cache, last_only=prompt_logprobs is None)
        if prompt_logprobs is not None:
            n = top_logprobs if prompt_top_logprobs is not None else 0
            _score_prompts(stage, logits, tokens, pad, n, prompt_logprobs, prompt_top_logprobs)
        # scoring: the prompts' logprobs only
        if max_new_tokens == 0:
            return
        finished: list[str | None] = [None] * b
        generated: list[list[int]] = [[] for _ in range(b)]
        for step in range(max_new_tokens):
            shared = None
            if stage.last:
                last = logits[:, -1]
                ids = sample(last, sampling, fold_in(seeds, step))
                chosen = _with_top(
                    token_logprobs(last, ids), torch.log_softmax(last.float(), -1), top_logprobs
                )
                shared = torch.cat([ids.double()[:, None], chosen], dim=1)
            shared = stage.share(shared, torch.empty(b, 2 + 2 * top_logprobs)).cpu()
            ids, lps = shared[:, 0].long().tolist(), shared[:, 1].tolist()
            top = [_pairs(row) for row in shared[:, 2:]] if top_logprobs else None
            was = list(finished)
            new_ids, new_lps = _advance(
                ids, lps, finished, generated, eod, stop, step == max_new_tokens - 1
            )
            yield Step(
                new_ids,
                new_lps,
                [f if w is None else None for f, w in zip(finished, was)],
                None
                if top is None
                else [t if i is not None else None for t, i in zip(top, new_ids)],
            )
            if all(f is not None for f in finished):
                return
            logits, cache = stage.forward(
                torch.tensor(ids, device=device)[:, None], cache, last_only=True
            )


def _score_prompts(
    stage: Any,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    pad: torch.Tensor,
    n: int,
    prompt_logprobs: list,
    prompt_top_logprobs: list | None,
) -> None:
    """Each row's prompt-token logprobs (and with n, the n likeliest pairs at each position) into
    the lists, from the last stage's logits shared with every rank."""
    b, longest = tokens.shape
    shared = None
    if stage.last:
        every = torch.log_softmax(logits[:, :-1].float(), -1)
        shared = _with_top(every.gather(-1, tokens[:, 1:, None])[..., 0], every, n)
    shared = stage.share(shared, torch.empty(b, longest - 1, 1 + 2 * n)).cpu()
    prompt_logprobs.extend(shared[r, pad[r] :, 0].float().tolist() for r in range(b))
    if n:
        prompt_top_logprobs.extend(
            [_pairs(row) for row in shared[r, pad[r] :, 1:]] for r in range(b)
        )


def _advance(
    ids: list[int],
    lps: list[float],
    finished: list,
    generated: list[list[int]],
    eod: int | None,
    stop: Callable | None,
    last_step: bool,
) -> tuple[list, list]:
    """Each unfinished row takes its new token (finished updated in place: "eod", "stop" or
    "length"); returns the step's ids and logprobs, None for rows finished before it."""
    new_ids, new_lps = list(ids), list(lps)
    for r in range(len(ids)):
        if finished[r] is not None:
            new_ids[r] = new_lps[r] = None
            continue
        generated[r].append(ids[r])
        if eod is not None and ids[r] == eod:
            finished[r] = "eod"
        elif stop is not None and stop(r, generated[r]):
            finished[r] = "stop"
        elif last_step:
            finished[r] = "length"
    return new_ids, new_lps


def _with_top(chosen: torch.Tensor, logprobs: torch.Tensor, n: int) -> torch.Tensor:
    """[..., 1 + 2n] float64: the chosen ids' logprobs, then the n likeliest ids and their
    logprobs."""
    if not n:
        return chosen.double()[..., None]
    values, ids = logprobs.topk(n, dim=-1)
    return torch.cat([chosen.double()[..., None], ids.double(), values.double()], dim=-1)


def _pairs(row: torch.Tensor) -> list[tuple[int, float]]:
    """(id, logprob) pairs of _with_top's last 2n values (float64 carries ids exactly)."""
    n = row.shape[-1] // 2
    return [(int(i), float(v)) for i, v in zip(row[:n].tolist(), row[n:].tolist())]


def generate(
    params: Params,
    prompts: list[list[int]],
    config: GPTConfig,
    *,
    max_new_tokens: int,
    return_prompt_logprobs: bool = False,
    **options: Any,
) -> Generation:
    """Every row's generated ids, their logprobs and why it stopped (see stream for the options)."""
    out = Generation(
        [[] for _ in prompts],
        [[] for _ in prompts],
        ["length"] * len(prompts),
        [] if return_prompt_logprobs else None,
    )
    for step in stream(
        params,
        prompts,
        config,
        max_new_tokens=max_new_tokens,
        prompt_logprobs=out.prompt_logprobs,
        **options,
    ):
        for r, (i, lp, done) in enumerate(zip(step.ids, step.logprobs, step.finished)):
            if i is not None:
                out.tokens[r].append(i)
                out.logprobs[r].append(lp)
            if done is not None:
                out.finish_reasons[r] = done
    return out
