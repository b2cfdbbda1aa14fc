"""How the ranks of recipes.serve share a job: rank 0 plans it (token ids, seeds, stop rules; a prompt
that does not fit is a BadRequest before any rank hears of it) and broadcasts it as JSON bytes (never a
pickle); every other rank follows, running its part of the same generation, and survives a job that fails.
"""

from __future__ import annotations

import json
import secrets
import sys
from typing import Iterator

import torch
import torch.distributed as dist

from fmeg.inference import SamplingParams
from recipes.generate import LoadedModel, encode, stop_on_strings
from recipes.serve_api import MAX_SEED, BadRequest, Job

STOP_SERVING = b""


def plan(job: Job, model: LoadedModel) -> dict:
    """The job as every rank runs it: token ids, seeds and stop rules (raises BadRequest on prompts that do
    not fit the model)."""
    tokenizer, config = model.tokenizer, model.config
    ids = []
    for i, text in enumerate(job.prompts):
        if isinstance(text, list):  # token ids, as evaluation harnesses send them
            if min(text) < 0 or max(text) >= config.vocab_size:
                raise BadRequest(f"prompt {i} has a token id outside the vocabulary [0, {config.vocab_size})")
            ids.append(([tokenizer.eod] if job.add_bos else []) + list(text))
            continue
        try:
            ids.append(([tokenizer.eod] if job.add_bos else []) + encode(tokenizer, text))
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer cannot read is the request's problem
            raise BadRequest(f"prompt {i} cannot be tokenized ({type(e).__name__}: {str(e)[:100]})") from None
    for i, row in enumerate(ids):
        if not row:
            raise BadRequest(f"prompt {i} is empty")
        if len(row) + job.max_new_tokens > config.max_seq_len:
            raise BadRequest(f"prompt {i} is {len(row)} tokens; with {job.max_new_tokens} to generate that exceeds "
                             f"the model's {config.max_seq_len} positions")
    seed = secrets.randbits(31) if job.seed is None else job.seed
    seeds = [(seed + i) % (MAX_SEED + 1) for i in range(len(ids))]  # prompt i samples with seed + i, in int64
    return {"prompts": ids, "max_new_tokens": job.max_new_tokens, "temperature": job.sampling.temperature,
            "top_k": job.sampling.top_k, "top_p": job.sampling.top_p, "seeds": seeds,
            "eod": tokenizer.eod if job.stop_token is None else job.stop_token, "stop": job.stop,
            "prompt_logprobs": job.logprobs, "top_logprobs": job.top_logprobs}


def run_plan(model: LoadedModel, p: dict, prompt_logprobs: list | None, prompt_top: list | None = None) -> Iterator:
    """This rank's part of the generation p describes (the same Steps on every rank)."""
    return model.stream(p["prompts"], max_new_tokens=p["max_new_tokens"], seed=p["seeds"], eod=p["eod"],
                        stop=stop_on_strings(model.tokenizer, p["stop"]),
                        sampling=SamplingParams(p["temperature"], p["top_k"], p["top_p"]),
                        prompt_logprobs=prompt_logprobs, top_logprobs=p.get("top_logprobs", 0),
                        prompt_top_logprobs=prompt_top if p.get("top_logprobs") else None)


class Broadcast:
    """Rank 0 tells the other ranks the next job (JSON bytes in a uint8 tensor); empty bytes: stop."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device

    def send(self, payload: bytes) -> None:
        if self.world > 1:
            self._exchange(payload)

    def receive(self) -> bytes:
        return self._exchange(None)

    def _exchange(self, payload: bytes | None) -> bytes:
        sending = payload is not None
        size = torch.tensor([len(payload) if sending else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        n = int(size.item())
        data = torch.tensor(list(payload), dtype=torch.uint8, device=self.device) if sending and n else \
            torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            dist.broadcast(data, src=0)
        return payload if sending else bytes(data.cpu().tolist())


def follow(model: LoadedModel, broadcast: Broadcast) -> None:
    """The loop of every rank but 0: run each job rank 0 sends, until it says stop."""
    while True:
        payload = broadcast.receive()
        if payload == STOP_SERVING:
            return
        p = json.loads(payload)
        try:
            for _ in run_plan(model, p, [] if p["prompt_logprobs"] else None, []):
                pass
        except Exception as e:  # noqa: BLE001 - a request must never end a rank; rank 0 answers it
            print(f"error: rank {dist.get_rank() if dist.is_initialized() else 0}: a request failed "
                  f"({type(e).__name__}: {str(e)[:200]}); serving on", file=sys.stderr, flush=True)
