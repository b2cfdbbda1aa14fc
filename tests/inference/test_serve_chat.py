"""OpenAI's chat completions from recipes.serve, asked with the official openai client: a tiny Qwen3
chat model imported, fine-tuned with --sft and served answers what transformers' apply_chat_template
+ greedy generate answer on its export (the same text, the same logprobs), streamed or not;
/v1/models names it; what the endpoint does not implement is a 400 with the field's name."""

import json
import sys

import pytest
import torch

from harness.runner import Server, run_group

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flask")
pytest.importorskip("jinja2")

QUESTIONS = ["What is the capital of Peru?", "What is the capital of Chile?"]


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """(the chat model's directory, fmeg's fine-tuned checkpoint, its transformers export): the
    fine-tuning commands of docs/fine-tuning.md at one rank, shortened."""
    root = tmp_path_factory.mktemp("chat")
    steps = [
        [
            "-m",
            "recipes.tiny_chat_model",
            "--output",
            str(root / "qwen3_chat"),
            "--conversations",
            str(root / "chat.jsonl"),
            "--lines",
            "400",
        ],
        [
            "-m",
            "recipes.convert_checkpoint",
            "import-hf",
            "--input",
            str(root / "qwen3_chat"),
            "--save",
            str(root / "imported"),
        ],
        [
            "-m",
            "recipes.gpt_pretrain",
            "--load",
            str(root / "imported"),
            "--use-checkpoint-args",
            "--finetune",
            "--sft",
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            str(root / "qwen3_chat"),
            "--data-path",
            str(root / "chat.jsonl"),
            "--sft-sequence-packing",
            "--seq-length",
            "128",
            "--global-batch-size",
            "8",
            "--train-iters",
            "40",
            "--lr",
            "3e-3",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--save",
            str(root / "sft"),
            "--log-dir",
            str(root / "log"),
            "--data-cache-path",
            str(root / "cache"),
        ],
        [
            "-m",
            "recipes.convert_checkpoint",
            "export-hf",
            "--load",
            str(root / "sft"),
            "--output",
            str(root / "sft_hf"),
        ],
    ]
    for argv in steps:
        out = run_group([sys.executable, *argv], timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return root / "qwen3_chat", root / "sft", root / "sft_hf"


@pytest.fixture(scope="module")
def chat_server(fine_tuned):
    server = Server(str(fine_tuned[1]), extra=["--model-name", "qwen3-sft"])
    yield server
    server.stop()


def transformers_answer(fine_tuned, question: str, tokens: int) -> tuple[str, list[float], str]:
    """(text, logprob of each generated token before the end of turn, finish reason) of
    transformers' greedy answer, as its model card has users ask."""
    tok = transformers.AutoTokenizer.from_pretrained(fine_tuned[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        fine_tuned[2], dtype=torch.float32
    ).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, new)]
    ended = tok.eos_token_id in new
    kept = new[: new.index(tok.eos_token_id)] if ended else new
    return tok.decode(kept), logprobs[: len(kept)], "stop" if ended else "length"


def client(server):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
    )


def ask(server, question: str, **options):
    """The official client's greedy chat completion of one question, at most 12 tokens."""
    return client(server).chat.completions.create(
        model="qwen3-sft",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=12,
        **options,
    )


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_completion_is_transformers_greedy_answer_streamed_or_not(
    fine_tuned, chat_server, question
):
    text, logprobs, finish = transformers_answer(fine_tuned, question, 12)
    assert text, "the fine-tuned model answers nothing: there would be no tokens to compare"
    answer = ask(chat_server, question, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        text,
        finish,
    )
    got = [entry.logprob for entry in choice.logprobs.content]
    assert len(got) == len(logprobs) and max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4
    assert all(
        len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        for entry in choice.logprobs.content
    )
    assert answer.usage.completion_tokens == len(logprobs) + (finish == "stop")
    stream = ask(chat_server, question, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == [finish]
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_a_stop_string_and_the_models_list(fine_tuned, chat_server):
    text, _, _ = transformers_answer(fine_tuned, QUESTIONS[0], 12)
    cut = text[: max(1, len(text) // 2)]
    stop = text[len(cut) : len(cut) + 2] or text[-1]
    answer = ask(chat_server, QUESTIONS[0], stop=[stop])
    assert answer.choices[0].message.content == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert [m.id for m in client(chat_server).models.list()] == ["qwen3-sft"]


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": []},
            "tools: tool and function calling",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n: only n=1 is implemented"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role must be one of"),
        ({"messages": []}, "messages must be a non-empty list"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "with logprobs: true",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
            "exceeds the model's",
        ),
        ({"prompt": "hi"}, "unknown field 'prompt'"),
    ],
)
def test_what_chat_does_not_take_is_a_400_naming_it(chat_server, body, message):
    status, text = chat_server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and message in json.loads(text)["error"]["message"], text
