"""Serve a checkpoint over HTTP: Megatron's `PUT /api` and OpenAI's `POST /v1/completions` and `POST
/v1/chat/completions` (recipes/serve_openai.py; the checkpoint's SFTTokenizer renders the messages).

    python -m recipes.serve --load checkpoints/gpt --port 5000
    python -m fmeg.launch --nproc-per-node 2 -m recipes.serve --load checkpoints/gpt \\
        --tensor-model-parallel-size 2
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["import os"], "tokens_to_generate": 32}'
    curl localhost:5000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "import os", "max_tokens": 32, "stream": true}'

Rank 0 runs the web server (Flask, as Megatron's: pip install "fmeg[serve]"); every other rank waits
for rank 0 to broadcast the next job as JSON (never a pickle) and runs its part of the same
generation. Requests are served one at a time, each as one batch of its prompts. A bad request gets
HTTP 400 and a one-line reason (`recipes/serve_api.py`) and never reaches the other ranks; the
server stays up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import secrets
import signal
import socket
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from fmeg.cli import OneLineParser
from recipes import serve_openai
from recipes.generate import (
    LoadedModel,
    TextStream,
    cut_at_stop,
    flag_problems,
    load_model,
    model_flags,
    refuse,
)
from recipes.serve_api import (
    BadRequest,
    Job,
    ModelNotFound,
    chat_job,
    check_model,
    megatron_job,
    openai_job,
    parse_json,
)
from recipes.serve_ranks import (
    KEEP_ALIVE_S,
    STOP_SERVING,
    STOP_SIGNALS,
    STOPPED_BY,
    Broadcast,
    follow,
    follower_stop,
    interrupt,
    plan,
    run_plan,
)


class Completion:
    """One row's text as it grows: partial characters held back, cut at a stop string, and (while
    streaming) the tail that could still become a stop string held back too."""

    def __init__(self, tokenizer: Any, stops: list[str], eod: int):
        self.tokenizer, self.text, self.stops, self.eod = (
            tokenizer,
            TextStream(tokenizer),
            stops,
            eod,
        )
        self.ids, self.logprobs, self.top, self.full, self.sent = [], [], [], "", 0
        self.finish: str | None = None

    def add(self, token: int, logprob: float, finished: str | None, top: list | None = None) -> str:
        """Take one step; return the new text that is now certain (at the end, all of it: a partial
        character is decoded as the tokenizer decodes it, so the text agrees with its tokens)."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.top.append(top)
        if token != self.eod:
            self.full += self.text.add(token)
        if finished:
            self.full = self.tokenizer.decode([t for t in self.ids if t != self.eod])
        self.finish = finished
        visible = cut_at_stop(self.full, self.stops)
        hold = 0 if finished else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(visible) - hold)
        piece, self.sent = visible[self.sent : end], end
        return piece

    @property
    def final_text(self) -> str:
        return cut_at_stop(self.full, self.stops)


class Generation:
    """What the routes share: the model, and one generation at a time under the broadcast's lock,
    which tells the other ranks each job before this rank begins its part."""

    def __init__(self, model: LoadedModel, broadcast: Broadcast, name: str):
        self.model, self.broadcast, self.name, self.tokenizer = (
            model,
            broadcast,
            name,
            model.tokenizer,
        )

    def start(self, job: Job, p: dict, who: str) -> tuple[Iterator, list | None, list]:
        """Under the lock: tell the other ranks the planned job and begin this rank's part."""
        if job.log:
            print(
                f"request from {who}: {len(p['prompts'])} prompt(s), {p['max_new_tokens']} tokens",
                flush=True,
            )
        self.broadcast.send(json.dumps(p).encode())
        prompt_logprobs, prompt_top = [] if job.logprobs else None, []
        return run_plan(self.model, p, prompt_logprobs, prompt_top), prompt_logprobs, prompt_top

    def run(
        self, job: Job, who: str, p: dict | None = None
    ) -> tuple[dict, list[Completion], list | None, list]:
        """The whole job: (its plan, one Completion per prompt, the prompts' logprobs and top
        tokens)."""
        p = p or plan(job, self.model)
        with self.broadcast.lock:
            steps, prompt_logprobs, prompt_top = self.start(job, p, who)
            rows = [Completion(self.tokenizer, job.stop, p["eod"]) for _ in p["prompts"]]
            for step in steps:
                tops = step.top or [None] * len(rows)
                for row, token, lp, done, top in zip(
                    rows, step.ids, step.logprobs, step.finished, tops
                ):
                    if token is not None:
                        row.add(token, lp, done, top)
        return p, rows, prompt_logprobs, prompt_top

    def sse(self, job: Job, p: dict, chunks: Any, who: str) -> Iterator[str]:
        """Server-sent events of one streamed row, each step's chunks as `chunks` (a completion's or
        a chat's) shapes them; with include_usage a last chunk with the usage, then [DONE]."""
        # held until the stream ends, or the client leaves and the generator is closed
        with self.broadcast.lock:
            steps, _, _ = self.start(job, p, who)
            row = Completion(self.tokenizer, job.stop, p["eod"])
            try:
                for c in chunks.opening():
                    yield f"data: {json.dumps(c)}\n\n"
                for step in steps:
                    if step.ids[0] is None:
                        continue
                    top = step.top[0] if step.top else None
                    piece = row.add(step.ids[0], step.logprobs[0], step.finished[0], top)
                    finish = serve_openai.openai_reason(row.finish) if row.finish else None
                    for c in chunks.step(piece, finish, step.ids[0], step.logprobs[0], top):
                        yield f"data: {json.dumps(c)}\n\n"
                # OpenAI's include_usage: a last chunk with no choices and the usage
                if job.usage_chunk:
                    used, made = len(p["prompts"][0]), len(row.ids)
                    usage = {
                        "prompt_tokens": used,
                        "completion_tokens": made,
                        "total_tokens": used + made,
                    }
                    yield f"data: {json.dumps({**chunks.head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                # a client that left early: the other ranks are mid-generation, so finish it with
                # them
                for _ in steps:
                    pass


def megatron_answer(gen: Generation, body: bytes, who: str) -> dict:
    """PUT /api: Megatron's text generation server's answer."""
    job = megatron_job(parse_json(body))
    p, rows, prompt_logprobs, _ = gen.run(job, who)
    out = {
        "text": [text + row.final_text for text, row in zip(job.prompts, rows)],
        "tokens": [ids + row.ids for ids, row in zip(p["prompts"], rows)],
        "segments": [
            [gen.tokenizer.decode([t]) for t in ids + row.ids]
            for ids, row in zip(p["prompts"], rows)
        ],
    }
    if job.logprobs:
        out["logprobs"] = [lp + row.logprobs for lp, row in zip(prompt_logprobs, rows)]
    return out


def completions_answer(gen: Generation, body: bytes, who: str) -> dict | Iterator[str]:
    """POST /v1/completions: OpenAI's completion, or its stream of server-sent events."""
    job, tokenizer = openai_job(parse_json(body)), gen.tokenizer
    head = {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": gen.name,
    }
    if job.stream:
        prompt = (
            job.prompts[0] if isinstance(job.prompts[0], str) else tokenizer.decode(job.prompts[0])
        )
        chunks = serve_openai.CompletionChunks(head, tokenizer, job, prompt)
        return gen.sse(job, plan(job, gen.model), chunks, who)
    p, rows, prompt_logprobs, prompt_top = gen.run(job, who)
    choices = []
    for i, (prompt, ids, row) in enumerate(zip(job.prompts, p["prompts"], rows)):
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        logprobs = None
        if job.logprobs:
            logprobs = serve_openai.openai_logprobs(
                tokenizer,
                job,
                ids,
                prompt_logprobs[i] if job.echo else None,
                prompt_top[i] if job.echo and prompt_top else None,
                row,
                len(text),
            )
        choices.append(
            {
                "text": (text if job.echo else "") + row.final_text,
                "index": i,
                "logprobs": logprobs,
                "finish_reason": serve_openai.openai_reason(row.finish),
            }
        )
    used = sum(len(ids) for ids in p["prompts"])
    made = sum(len(row.ids) for row in rows)
    return {
        **head,
        "choices": choices,
        "usage": {"prompt_tokens": used, "completion_tokens": made, "total_tokens": used + made},
    }


def chat_answer(gen: Generation, body: bytes, who: str) -> dict | Iterator[str]:
    """POST /v1/chat/completions: OpenAI's chat completion, or its stream of server-sent events."""
    request = parse_json(body)
    check_model(request, gen.name)
    tokenizer = gen.tokenizer
    if not serve_openai.has_template(tokenizer):
        raise BadRequest(
            "this server's tokenizer has no chat template: serve a model with --tokenizer-type "
            "SFTTokenizer --tokenizer-model DIR (a Hugging Face directory with its chat template)"
        )
    job = chat_job(request, tokenizer.chat_prompt, gen.model.config.max_seq_len)
    head = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": gen.name,
    }
    p = plan(job, gen.model)
    if job.stream:
        chunks = serve_openai.ChatChunks(head, tokenizer, p["eod"], job.logprobs, job.usage_chunk)
        return gen.sse(job, p, chunks, who)
    p, rows, _, _ = gen.run(job, who, p)
    return serve_openai.answer(
        head,
        tokenizer,
        rows[0],
        p["eod"],
        job.logprobs,
        len(p["prompts"][0]),
        serve_openai.openai_reason(rows[0].finish),
    )


def make_app(model: LoadedModel, broadcast: Broadcast, name: str):
    from flask import Flask, Response, request

    app = Flask("fmeg.serve")
    gen = Generation(model, broadcast, name)

    def answer(route: Any) -> Any:
        out = route(gen, request.get_data(), request.remote_addr)
        return out if isinstance(out, dict) else Response(out, mimetype="text/event-stream")

    @app.errorhandler(BadRequest)
    def bad_request(e: BadRequest):
        if request.path.startswith("/v1/"):
            return {
                "error": {
                    "message": str(e),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }, 400
        # Megatron's text_generation_cli prints response.json()["message"]
        return {"message": str(e)}, 400

    @app.errorhandler(ModelNotFound)
    def model_not_found(e: ModelNotFound):
        # OpenAI's answer to a model it does not serve
        error = {"message": str(e), "type": "invalid_request_error", "param": "model"}
        return {"error": {**error, "code": "model_not_found"}}, 404

    @app.errorhandler(Exception)
    # a request that failed inside generation: one line, and the server goes on
    def failed(e: Exception):
        from werkzeug.exceptions import HTTPException

        # 404, 405, ...: werkzeug's own answer
        if isinstance(e, HTTPException):
            return e
        message = f"generation failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        print(f"error: {message}", file=sys.stderr, flush=True)
        if request.path.startswith("/v1/"):
            return {
                "error": {"message": message, "type": "server_error", "param": None, "code": None}
            }, 500
        return {"message": message}, 500

    app.put("/api", endpoint="megatron_api")(lambda: answer(megatron_answer))
    app.get("/v1/models", endpoint="models")(
        lambda: {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "fmeg"}]}
    )
    app.post("/v1/completions", endpoint="completions")(lambda: answer(completions_answer))
    app.post("/v1/chat/completions", endpoint="chat_completions")(lambda: answer(chat_answer))
    return app


def main(argv: list[str] | None = None) -> int:
    # inference only, and the caller's grad mode stays as it was
    with torch.no_grad():
        return _main(argv)


def _listen(a: argparse.Namespace, app: Any) -> Any:
    """The web server on --host and --port, or None after one line naming the flag that failed."""
    from werkzeug.serving import make_server

    said = io.StringIO()
    # werkzeug prints its own lines and exits 1 on a busy port: one line of ours instead
    try:
        socket.getaddrinfo(a.host, a.port)
        with contextlib.redirect_stderr(said):
            return make_server(a.host, a.port, app, threaded=True)
    except socket.gaierror as e:
        print(
            f"error: --host {a.host}: not an address of this machine ({e.strerror or e}); use "
            "127.0.0.1 or 0.0.0.0",
            file=sys.stderr,
        )
    except (OSError, SystemExit) as e:
        why = getattr(e, "strerror", None) or next(
            (line for line in said.getvalue().splitlines() if line), ""
        )
        print(
            f"error: --port {a.port} on --host {a.host}: {why or 'cannot listen there'}; choose "
            "another port",
            file=sys.stderr,
        )
    return None


def _main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m recipes.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument(
        "--model-name", default=None, help="the model's name in OpenAI responses (default: --load)"
    )
    a = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    problems = flag_problems(a, world) + (
        [f"--port must be in [0, 65535], got {a.port}"] if not 0 <= a.port <= 65535 else []
    )
    if importlib.util.find_spec("flask") is None:
        problems.append(
            'recipes.serve needs Flask: pip install "fmeg[serve]" (or pip install flask)'
        )
    if problems:
        return refuse(problems)
    try:
        model = load_model(a)
    except (ValueError, OSError) as e:
        return refuse([str(e)])
    broadcast = Broadcast(world, model.device)
    if rank != 0:
        for s in STOP_SIGNALS:
            signal.signal(s, follower_stop)
        follow(model, broadcast)
        dist.destroy_process_group()
        return 0
    server = _listen(a, make_app(model, broadcast, a.model_name or a.load))
    if server is None:
        broadcast.send(STOP_SERVING)
        return 2
    print(
        f"serving {a.load} on http://{a.host}:{server.port} (PUT /api, POST /v1/completions, POST "
        f"/v1/chat/completions); tp {a.tensor_model_parallel_size} x pp "
        f"{a.pipeline_model_parallel_size}",
        flush=True,
    )
    # a clean stop: the other ranks are told to finish
    for s in STOP_SIGNALS:
        signal.signal(s, interrupt)
    broadcast.keep_alive(min(KEEP_ALIVE_S, a.distributed_timeout_minutes * 60 / 4))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        try:
            # after the job in flight, if any
            with broadcast.lock:
                broadcast.send(STOP_SERVING)
            if world > 1:
                dist.destroy_process_group()
        # a rank already gone, which the launcher names: nothing is left to tell
        except RuntimeError:
            pass
    # a stop asked for is a clean exit (0), said in one line so that a log shows why it ended
    if STOPPED_BY:
        print(f"stopped by {STOPPED_BY[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
