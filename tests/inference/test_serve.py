"""recipes.serve as clients use it: real HTTP requests to a running server (Megatron's PUT /api and
OpenAI's /v1/completions, streamed and not), bad requests answered with 400 and a reason."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fmeg.inference import SamplingParams, generate
from recipes.convert_checkpoint import load_full
from harness.runner import Server

pytest.importorskip("flask")


@pytest.fixture(scope="module")
def server(trained_checkpoint):
    s = Server(trained_checkpoint)
    yield s
    s.stop()


def _greedy(checkpoint, prompts, tokens):
    config, params = load_full(checkpoint)
    return generate(
        params,
        [list(p.encode()) for p in prompts],
        config,
        max_new_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
        eod=256,
    )


def test_megatron_api_answers_as_megatron_does(server, trained_checkpoint):
    """text_generation_cli's request: PUT /api with prompts and tokens_to_generate; top_k 1 is
    greedy."""
    status, body = server.request(
        "PUT",
        "/api",
        {
            "prompts": ["import os\n", "def f("],
            "tokens_to_generate": 12,
            "top_k": 1,
            "logprobs": True,
        },
    )
    assert status == 200, body
    out = json.loads(body)
    want = _greedy(trained_checkpoint, ["import os\n", "def f("], 12)
    for i, prompt in enumerate(["import os\n", "def f("]):
        ids = list(prompt.encode())
        assert out["tokens"][i] == ids + want.tokens[i]
        assert out["text"][i] == prompt + bytes(t for t in want.tokens[i] if t < 256).decode(
            errors="replace"
        )
        assert len(out["segments"][i]) == len(out["tokens"][i])
        assert len(out["logprobs"][i]) == len(out["tokens"][i]) - 1  # every token but the first
        assert (
            max(abs(a - b) for a, b in zip(out["logprobs"][i][len(ids) - 1 :], want.logprobs[i]))
            < 1e-5
        )


def test_openai_completions_plain_and_streamed_agree(server, trained_checkpoint):
    request = {"prompt": "import sys", "max_tokens": 10, "temperature": 0, "logprobs": 0}
    status, body = server.request("POST", "/v1/completions", request)
    assert status == 200, body
    out = json.loads(body)
    want = _greedy(trained_checkpoint, ["import sys"], 10)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and choice["finish_reason"] in ("length", "stop")
    assert choice["text"] == bytes(t for t in want.tokens[0] if t < 256).decode(errors="replace")
    assert out["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": len(want.tokens[0]),
        "total_tokens": 10 + len(want.tokens[0]),
    }
    assert (
        max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want.logprobs[0]))
        < 1e-5
    )
    status, body = server.request("POST", "/v1/completions", {**request, "stream": True})
    assert status == 200
    events = [
        line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


def test_a_stop_string_ends_the_text_before_it(server):
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": "import os", "max_tokens": 30, "temperature": 0}
    )
    text = json.loads(body)["choices"][0]["text"]
    stop = text[3:5]
    for stream in (False, True):
        status, body = server.request(
            "POST",
            "/v1/completions",
            {
                "prompt": "import os",
                "max_tokens": 30,
                "temperature": 0,
                "stop": stop,
                "stream": stream,
            },
        )
        if stream:
            chunks = [
                json.loads(line[6:])["choices"][0]
                for line in body.splitlines()
                if line.startswith("data: {")
            ]
            got, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        else:
            got, reason = (
                json.loads(body)["choices"][0]["text"],
                json.loads(body)["choices"][0]["finish_reason"],
            )
        assert got == text[: text.index(stop)] and reason == "stop"


@pytest.mark.parametrize(
    "method, path, body, message",
    [
        ("PUT", "/api", b'{"prompts": ["x"', "malformed JSON"),
        ("POST", "/v1/completions", b"{'prompt': 1}", "malformed JSON"),
        (
            "PUT",
            "/api",
            {"prompts": ["x"], "tokens_to_generate": -3},
            "tokens_to_generate must be an integer",
        ),
        (
            "POST",
            "/v1/completions",
            {"prompt": "x", "max_tokens": -1},
            "max_tokens must be an integer",
        ),
        ("PUT", "/api", {"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ("POST", "/v1/completions", {"prompt": ""}, "prompt is empty"),
        ("PUT", "/api", {"prompts": ["x" * 80]}, "exceeds the model's 64 positions"),
        (
            "POST",
            "/v1/completions",
            {"prompt": "x" * 60, "stream": True},
            "exceeds the model's 64 positions",
        ),
        ("PUT", "/api", {"prompts": ["x"], "colour": "red"}, "unknown field 'colour'"),
        ("POST", "/v1/completions", {"prompt": "x", "colour": "red"}, "unknown field 'colour'"),
        ("PUT", "/api", {"prompts": ["x"], "beam_width": 2}, "beam search is not implemented"),
        (
            "POST",
            "/v1/completions",
            {"prompt": "x", "temperature": "hot"},
            "temperature must be a number",
        ),
        ("PUT", "/api", [1, 2], "must be a JSON object"),
    ],
)
def test_bad_requests_get_400_with_a_reason_and_the_server_stays_up(
    server, method, path, body, message
):
    status, text = server.request(method, path, body)
    assert status == 400 and message in text, text
    reason = (
        json.loads(text)["error"]["message"]
        if path.startswith("/v1/")
        else json.loads(text)["message"]
    )
    # /api: what Megatron's text_generation_cli prints
    assert message in reason and "\n" not in reason
    status, _ = server.request("PUT", "/api", {"prompts": ["ok"], "tokens_to_generate": 2})
    assert status == 200


def test_a_tensor_parallel_server_answers_as_one_rank(server, trained_checkpoint):
    request = {
        "prompts": ["import os\n", "x = "],
        "tokens_to_generate": 12,
        "temperature": 0.8,
        "random_seed": 3,
        "logprobs": True,
    }
    _, alone = server.request("PUT", "/api", request)
    sharded = Server(trained_checkpoint, nproc=2, extra=["--tensor-model-parallel-size", "2"])
    try:
        status, body = sharded.request("PUT", "/api", request)
        streamed = sharded.request(
            "POST",
            "/v1/completions",
            {"prompt": "import os\n", "max_tokens": 8, "stream": True, "seed": 3},
        )
    finally:
        sharded.stop()
    assert status == 200, body
    got, want = json.loads(body), json.loads(alone)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert streamed[0] == 200 and streamed[1].rstrip().endswith("data: [DONE]")


# Malformed and out-of-range requests of every kind: each is answered 400 by rank 0 and none reaches
# a rank.
HOSTILE = [
    (
        "PUT",
        "/api",
        {"prompts": ["x"], "random_seed": 2**70},
        "random_seed must be an integer from 0 to 2**63 - 1",
    ),
    (
        "PUT",
        "/api",
        {"prompts": ["x"], "random_seed": 2**63},
        "random_seed must be an integer from 0 to 2**63 - 1",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "seed": 2**64},
        "seed must be an integer from 0 to 2**63 - 1",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "seed": -1},
        "seed must be an integer from 0 to 2**63 - 1",
    ),
    ("PUT", "/api", {"prompts": ["ab\ud800cd"]}, "prompts[0] is not valid text"),
    ("POST", "/v1/completions", {"prompt": "ab\udc00"}, "prompt[0] is not valid text"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop[0] is not valid text"),
    (
        "PUT",
        "/api",
        b'{"prompts": ["x"], "temperature": NaN}',
        "temperature must be a positive number",
    ),
    (
        "PUT",
        "/api",
        b'{"prompts": ["x"], "top_p": Infinity}',
        "top_p must be a number from 0 to 1.0",
    ),
    (
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "temperature": NaN}',
        "temperature must be a number from 0 to 2",
    ),
    (
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "top_p": -Infinity}',
        "top_p must be a number in (0, 1]",
    ),
    (
        "PUT",
        "/api",
        {"prompts": ["x"], "tokens_to_generate": 2**70},
        "tokens_to_generate must be an integer",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2**70},
        "max_tokens must be an integer",
    ),
    ("PUT", "/api", {"prompts": ["x"], "stop_token": 2**70}, "stop_token must be a token id"),
    ("PUT", "/api", {"prompts": ["x"], "stop_token": -5}, "stop_token must be a token id"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": 2**70}, "top_k must be an integer"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options is only allowed with stream: true",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options must be an object",
    ),
    ("PUT", "/api", {"prompts": ["x"] * 200}, "Maximum number of prompts is 128"),
    ("PUT", "/api", {"prompts": [1]}, "prompts is not a list of strings"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logprobs": 21},
        "logprobs must be an integer from 0 to 20",
    ),
    ("PUT", "/api", b"\xff\xfe", "malformed JSON"),
]


@pytest.fixture(scope="module")
def tp2_server(trained_checkpoint):
    s = Server(trained_checkpoint, nproc=2, extra=["--tensor-model-parallel-size", "2"])
    yield s
    s.stop()


def test_no_request_can_end_a_tensor_parallel_server(tp2_server, server):
    """The tp 2 server answers every hostile request with 400 and a reason, then answers a good
    request with the tokens one rank gives (a seed past int64 used to end rank 1, and with it the
    job)."""
    good = {
        "prompts": ["import os\n"],
        "tokens_to_generate": 8,
        "temperature": 0.8,
        "random_seed": 5,
    }
    _, before = server.request("PUT", "/api", good)
    for method, path, body, message in HOSTILE:
        status, text = tp2_server.request(method, path, body)
        assert status == 400 and message in text, (body, text)
    assert tp2_server.proc.poll() is None
    status, after = tp2_server.request("PUT", "/api", good)
    assert status == 200 and json.loads(after)["tokens"] == json.loads(before)["tokens"]


def test_the_largest_seed_samples_on_every_prompt(server):
    """Prompt i samples with seed + i, wrapped within int64: the largest seed is served, not a
    500."""
    status, body = server.request(
        "PUT", "/api", {"prompts": ["a", "b"], "tokens_to_generate": 2, "random_seed": 2**63 - 1}
    )
    assert status == 200, body


def test_chat_needs_a_tokenizer_with_a_chat_template(server):
    status, body = server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert (
        status == 400
        and "this server's tokenizer has no chat template" in json.loads(body)["error"]["message"]
    )


def test_chat_naming_another_model_is_openais_404_model_not_found(server):
    """A chat request naming a model other than the one served (the id GET /v1/models lists) gets
    OpenAI's 404 with code model_not_found, not this model's answer (issue 67); the listed id and
    a request without a model go on (here to the template this tokenizer lacks)."""
    status, body = server.request("GET", "/v1/models", None)
    served = json.loads(body)["data"][0]["id"]
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    status, body = server.request("POST", "/v1/chat/completions", {**hi, "model": "gpt-4"})
    error = json.loads(body)["error"]
    assert status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    assert (
        f"The model 'gpt-4' does not exist here: this server serves {served!r}"
        in (error["message"])
    )
    for request in ({**hi, "model": served}, hi, {**hi, "model": None}):
        status, body = server.request("POST", "/v1/chat/completions", request)
        assert status == 400 and "has no chat template" in json.loads(body)["error"]["message"]


def test_a_chat_asking_for_more_tokens_than_positions_is_told_the_bound():
    """max_tokens far past any model (10**12) names the model's positions left after the messages,
    as 10**6 does (issue 67: it was "must be an integer >= 0")."""
    from recipes.serve_api import BadRequest, chat_job

    hi = {"messages": [{"role": "user", "content": "hi"}]}
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(BadRequest) as e:
            chat_job({**hi, name: 10**12}, lambda messages: [1, 2, 3], 64)
        assert str(e.value) == (
            f"{name} {10**12} exceeds the model's 64 positions less the messages' 3 tokens: ask "
            "for at most 61"
        )
    assert chat_job({**hi, "max_tokens": 61}, lambda messages: [1, 2, 3], 64).max_new_tokens == 61


def test_scoring_request_returns_the_prompts_logprobs_as_megatron(server):
    """Megatron's scoring request: tokens_to_generate 0 with logprobs gives the prompt's
    log-probabilities (every token but the first), the same as a generating request reports for its
    prompt."""
    prompt = "import os\nimport sys\n"
    status, body = server.request(
        "PUT", "/api", {"prompts": [prompt], "tokens_to_generate": 0, "logprobs": True}
    )
    assert status == 200, body
    scored = json.loads(body)
    assert scored["tokens"] == [list(prompt.encode())] and scored["text"] == [prompt]
    assert len(scored["logprobs"][0]) == len(prompt.encode()) - 1
    _, body = server.request(
        "PUT", "/api", {"prompts": [prompt], "tokens_to_generate": 3, "logprobs": True, "top_k": 1}
    )
    generated = json.loads(body)["logprobs"][0][: len(prompt.encode()) - 1]
    assert max(abs(a - b) for a, b in zip(scored["logprobs"][0], generated)) < 1e-5


def test_include_usage_streams_a_last_chunk_with_the_usage(server):
    status, body = server.request(
        "POST",
        "/v1/completions",
        {
            "prompt": "import os",
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = [
        line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")
    ]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    usage, text = chunks[-1]["usage"], "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert usage["prompt_tokens"] == 9 and 1 <= usage["completion_tokens"] <= 5
    assert (
        usage["total_tokens"] == 9 + usage["completion_tokens"]
        and len(text.encode()) <= usage["completion_tokens"]
    )


def test_null_means_the_default_for_openais_optional_fields(server):
    status, body = server.request(
        "POST",
        "/v1/completions",
        {
            "prompt": "import os",
            "max_tokens": 3,
            "temperature": None,
            "top_p": None,
            "stop": None,
            "seed": None,
            "logprobs": None,
            "echo": None,
            "stream": None,
            "n": None,
            "stream_options": None,
            "user": None,
        },
    )
    assert status == 200 and len(json.loads(body)["choices"]) == 1, body


def test_a_completion_ending_inside_a_character_keeps_its_bytes():
    """The final text is what the tokenizer decodes of its tokens, a trailing partial character
    included (it used to be dropped), and the streamed pieces add up to it."""
    from fmeg.data.tokenizers import ByteTokenizer
    from recipes.serve import Completion

    tokenizer = ByteTokenizer()
    ids = list("naïve é".encode())[:-1]  # the last character cut after its first byte
    row, pieces = Completion(tokenizer, [], tokenizer.eod), []
    for i, t in enumerate(ids):
        pieces.append(row.add(t, -1.0, "length" if i == len(ids) - 1 else None))
    assert (
        row.final_text == tokenizer.decode(ids) == "naïve \ufffd"
        and "".join(pieces) == row.final_text
    )


def test_a_busy_port_or_a_bad_host_is_one_line(server, trained_checkpoint):
    """Not the web server's own lines and exit 1: one error line naming the flag, exit 2."""
    for extra, needle in (
        (["--port", str(server.port)], f"error: --port {server.port} on --host 127.0.0.1: "),
        (
            ["--host", "256.1.1.1", "--port", "0"],
            "error: --host 256.1.1.1: not an address of this machine",
        ),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "recipes.serve", "--load", trained_checkpoint, *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), out.stderr


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's LocalCompletionsAPI.parse_logprobs for one choice (its loglikelihood
    reading)."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_loglikelihood_requests_get_transformers_numbers(
    server, trained_checkpoint, tmp_path
):
    """lm-evaluation-harness's local-completions loglikelihood request, replayed as it sends it
    (token ids of context + continuation, max_tokens 1, logprobs 1, echo, temperature 0; lm-eval
    itself is too heavy for CI): its parse of the answer gives the continuation's log-likelihood and
    greedy flag that transformers computes from the same weights (export-hf)."""
    import torch
    import transformers

    from recipes.convert_checkpoint import main as convert

    assert (
        convert(["export-hf", "--load", trained_checkpoint, "--output", str(tmp_path / "hf")]) == 0
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    pairs = [
        ("import os\n", "import sys\n"),
        ("def main(", "):\n"),
        ("x = ", "1"),
        ("class A:", "\n    pass"),
    ]
    requests = [list(c.encode()) + list(t.encode()) for c, t in pairs]
    status, body = server.request(
        "POST",
        "/v1/completions",
        {
            "model": "fmeg",
            "prompt": requests,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    assert status == 200, body
    choices = sorted(json.loads(body)["choices"], key=lambda c: c["index"])
    for (context, continuation), ids, choice in zip(pairs, requests, choices):
        got, greedy = _lm_eval_parse(choice, len(context.encode()))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1, :257].double(), -1)
        picked = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        want = picked[len(context.encode()) - 1 :].sum().item()
        start = len(context.encode())
        want_greedy = bool((lp.argmax(-1)[start - 1 :] == torch.tensor(ids[start:])).all())
        assert abs(got - want) < 1e-4 * max(1.0, abs(want)), (context, got, want)
        assert greedy == want_greedy
        lps = choice["logprobs"]
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        # every prompt token's
        each = torch.tensor(lps["token_logprobs"][1 : len(ids)], dtype=torch.float64)
        assert (each - picked).abs().max().item() < 1e-4, (context, each, picked)
        assert (
            len(lps["tokens"])
            == len(lps["token_logprobs"])
            == len(lps["text_offset"])
            == len(ids) + 1
        )
        assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0


def test_echo_with_max_tokens_0_scores_the_prompt_alone_with_the_likeliest_tokens(server):
    prompt = "import os\nimport sys\n"
    status, body = server.request(
        "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5}
    )
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    lps = choice["logprobs"]
    assert choice["text"] == prompt and "".join(lps["tokens"]) == prompt
    assert len(lps["token_logprobs"]) == len(prompt.encode()) and lps["token_logprobs"][0] is None
    for lp, top in zip(lps["token_logprobs"][1:], lps["top_logprobs"][1:]):
        assert len(top) == 5 and max(top.values()) >= lp - 1e-6
    status, body = server.request("POST", "/v1/completions", {"prompt": prompt, "logprobs": 21})
    assert status == 400 and "logprobs must be an integer from 0 to 20" in body


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The process id of a worker of the launcher by its RANK (Linux: /proc)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in env:
            return int(entry)
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="fmeg.launch forwards SIGTERM on Linux")
def test_an_idle_tensor_parallel_server_outlives_its_timeout_and_sigterm_stops_it_cleanly(
    trained_checkpoint,
):
    """Rank 1 of an idle server waits in a broadcast; rank 0's keep-alive keeps that wait within
    --distributed-timeout-minutes (3 s here, idle for 9), and SIGTERM to the launcher ends every
    rank with exit 0, nothing on stderr (it used to be a KeyboardInterrupt traceback on rank 1 and
    143) and one last line saying so."""
    s = Server(
        trained_checkpoint,
        nproc=2,
        launcher="fmeg.launch",
        extra=["--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.05"],
    )
    try:
        time.sleep(9)
        status, body = s.request(
            "PUT", "/api", {"prompts": ["import os\n"], "tokens_to_generate": 4}
        )
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        said = s.proc.stdout.read()
    finally:
        s.stop()
    assert status == 200, body
    assert code == 0 and "Traceback" not in said and "error" not in said, said
    assert "stopped by SIGTERM" in said.splitlines(), said


@pytest.mark.slow  # 15 s; the clean stop is in the default suite
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="fmeg.launch forwards SIGTERM on Linux")
def test_sigterm_to_one_rank_alone_ends_the_server_with_one_line(trained_checkpoint):
    s = Server(
        trained_checkpoint,
        nproc=2,
        launcher="fmeg.launch",
        extra=["--tensor-model-parallel-size", "2"],
    )
    try:
        os.kill(_rank_pid(s.proc.pid, 1), signal.SIGTERM)
        code = s.proc.wait(60)
        said = s.proc.stdout.read()
    finally:
        s.stop()
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert code == 128 + signal.SIGTERM and "Traceback" not in said, said
    assert (
        len(errors) == 1 and "rank 1 was stopped by SIGTERM while rank 0 served on" in errors[0]
    ), said
