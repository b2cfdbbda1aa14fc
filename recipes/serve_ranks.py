"""How the ranks of recipes.serve share a job: rank 0 plans it (token ids, seeds, stop rules; a
prompt that does not fit is a BadRequest before any rank hears of it) and broadcasts it as JSON
bytes (never a pickle); every other rank follows, running its part of the same generation, and
survives a job that fails. SIGTERM or SIGINT stops them together: rank 0 (interrupt) ends serving
and tells the others to stop; another rank (follower_stop) waits for that, and ends alone in one
line if it does not come.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from fmeg.inference import SamplingParams
from recipes.generate import LoadedModel, encode, stop_on_strings
from recipes.serve_api import MAX_SEED, BadRequest, Job

STOP_SERVING = b""
# no job: sent when rank 0 has been idle KEEP_ALIVE_S, so no rank's wait reaches the timeout
KEEP_ALIVE = b" "
KEEP_ALIVE_S = 60.0


def plan(job: Job, model: LoadedModel) -> dict:
    """The job as every rank runs it: token ids, seeds and stop rules (raises BadRequest on prompts
    that do not fit the model)."""
    tokenizer, config = model.tokenizer, model.config
    ids = []
    for i, text in enumerate(job.prompts):
        # token ids, as evaluation harnesses send them
        if isinstance(text, list):
            if min(text) < 0 or max(text) >= config.vocab_size:
                raise BadRequest(
                    f"prompt {i} has a token id outside the vocabulary [0, {config.vocab_size})"
                )
            ids.append(([tokenizer.eod] if job.add_bos else []) + list(text))
            continue
        try:
            ids.append(([tokenizer.eod] if job.add_bos else []) + encode(tokenizer, text))
        # whatever the tokenizer cannot read is the request's problem
        except Exception as e:  # noqa: BLE001
            raise BadRequest(
                f"prompt {i} cannot be tokenized ({type(e).__name__}: {str(e)[:100]})"
            ) from None
    for i, row in enumerate(ids):
        if not row:
            raise BadRequest(f"prompt {i} is empty")
        if len(row) + job.max_new_tokens > config.max_seq_len:
            raise BadRequest(
                f"prompt {i} is {len(row)} tokens; with {job.max_new_tokens} to generate that "
                f"exceeds the model's {config.max_seq_len} positions"
            )
    seed = secrets.randbits(31) if job.seed is None else job.seed
    # prompt i samples with seed + i, in int64
    seeds = [(seed + i) % (MAX_SEED + 1) for i in range(len(ids))]
    return {
        "prompts": ids,
        "max_new_tokens": job.max_new_tokens,
        "temperature": job.sampling.temperature,
        "top_k": job.sampling.top_k,
        "top_p": job.sampling.top_p,
        "seeds": seeds,
        "eod": tokenizer.eod if job.stop_token is None else job.stop_token,
        "stop": job.stop,
        "prompt_logprobs": job.logprobs,
        "top_logprobs": job.top_logprobs,
    }


def run_plan(
    model: LoadedModel, p: dict, prompt_logprobs: list | None, prompt_top: list | None = None
) -> Iterator:
    """This rank's part of the generation p describes (the same Steps on every rank)."""
    return model.stream(
        p["prompts"],
        max_new_tokens=p["max_new_tokens"],
        seed=p["seeds"],
        eod=p["eod"],
        stop=stop_on_strings(model.tokenizer, p["stop"]),
        sampling=SamplingParams(p["temperature"], p["top_k"], p["top_p"]),
        prompt_logprobs=prompt_logprobs,
        top_logprobs=p.get("top_logprobs", 0),
        prompt_top_logprobs=prompt_top if p.get("top_logprobs") else None,
    )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# how long a signalled rank other than 0 waits for rank 0's stop before it ends alone
FOLLOWER_GRACE_S = 5


# the signal that stopped rank 0's server (interrupt), for its last line; werkzeug's serve_forever
# swallows the KeyboardInterrupt that carries the stop
STOPPED_BY: list[str] = []


def interrupt(signum: int, _: Any) -> None:
    """Rank 0's first SIGTERM or SIGINT ends serve_forever (named in STOPPED_BY); later ones (a
    launcher forwarding the same stop) are ignored while the ranks are told to finish."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    STOPPED_BY.append(signal.Signals(signum).name)
    raise KeyboardInterrupt


def follower_stop(signum: int, _: Any) -> None:
    """A rank other than 0, signalled: it keeps waiting for rank 0's stop, which comes when the
    whole job was signalled (a launcher forwards SIGTERM to every rank); if none comes, it was
    signalled alone, and it ends with one line and 128 + the signal's number, so that the launcher
    stops the job."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)

    def alone(*_: Any) -> None:
        print(
            f"error: rank {os.environ.get('RANK', '?')} was stopped by "
            f"{signal.Signals(signum).name} while rank 0 served on; the server stops (signal the "
            "launcher, or every rank, for a clean stop)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    # a signal, not a thread: a collective's wait holds the GIL
    signal.signal(signal.SIGALRM, alone)
    signal.alarm(int(FOLLOWER_GRACE_S))


class Broadcast:
    """Rank 0 tells the other ranks the next job (JSON bytes in a uint8 tensor); empty bytes: stop.
    The sender holds `lock` from a job's broadcast to its last step (every rank runs one job at a
    time); keep_alive() then sends KEEP_ALIVE whenever rank 0 has been idle a while, since an idle
    server's other ranks wait in a collective, which would otherwise end at the process group's
    timeout."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self.lock, self.stopped = threading.Lock(), False

    def send(self, payload: bytes) -> None:
        if self.world > 1 and not self.stopped:
            self.stopped = payload == STOP_SERVING
            self._exchange(payload)

    def receive(self) -> bytes:
        return self._exchange(None)

    def keep_alive(self, every_s: float = KEEP_ALIVE_S) -> None:
        """On rank 0, in a daemon thread: KEEP_ALIVE every every_s seconds, between jobs, until the
        stop."""

        def beat() -> None:
            while not self.stopped:
                time.sleep(every_s)
                with self.lock:
                    self.send(KEEP_ALIVE)

        if self.world > 1:
            threading.Thread(target=beat, name="fmeg-serve-keep-alive", daemon=True).start()

    def _exchange(self, payload: bytes | None) -> bytes:
        sending = payload is not None
        size = torch.tensor([len(payload) if sending else 0], dtype=torch.int64, device=self.device)
        work = dist.broadcast(size, src=0, async_op=True)
        # waiting in Python, so that a signal's handler runs
        while not sending and not work.is_completed():
            time.sleep(0.02)
        work.wait()
        n = int(size.item())
        data = (
            torch.tensor(list(payload), dtype=torch.uint8, device=self.device)
            if sending and n
            else torch.empty(n, dtype=torch.uint8, device=self.device)
        )
        if n:
            dist.broadcast(data, src=0)
        return payload if sending else bytes(data.cpu().tolist())


def follow(model: LoadedModel, broadcast: Broadcast) -> None:
    """The loop of every rank but 0: run each job rank 0 sends, until it says stop."""
    while True:
        payload = broadcast.receive()
        if payload == STOP_SERVING:
            return
        if payload == KEEP_ALIVE:
            continue
        p = json.loads(payload)
        try:
            for _ in run_plan(model, p, [] if p["prompt_logprobs"] else None, []):
                pass
        except Exception as e:  # noqa: BLE001 - a request must never end a rank; rank 0 answers it
            print(
                f"error: rank {dist.get_rank() if dist.is_initialized() else 0}: a request failed "
                f"({type(e).__name__}: {str(e)[:200]}); serving on",
                file=sys.stderr,
                flush=True,
            )
