"""--sft: conversations rendered by the chat template as transformers renders them, trained on the
answers only (equal to transformers' {% generation %} masks), Megatron's named formats, samples that
pack conversations as documents of their own (cut, dropped and padded to 2 x cp as Megatron's
SFTDataset), and bad input in one line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.chat_data import TEMPLATES, chat_tokenizer_dir, random_conversation, write_jsonl
from fmeg.data.sft_corpus import SFTDataError, line_conversations, sft_corpus
from fmeg.data.sft_dataset import SFTDataset, build_sft_datasets, fate, packs
from fmeg.data.sft_tokenizer import SFTTokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        style: (
            SFTTokenizer(d := chat_tokenizer_dir(root, style)),
            transformers.AutoTokenizer.from_pretrained(d),
        )
        for style in TEMPLATES
    }


TEXT = st.text(alphabet="ab xyz\n✓é<|>", min_size=1, max_size=12).filter(lambda s: s.strip())


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    out = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(turns):
        out += [
            {"role": "user", "content": draw(TEXT)},
            {"role": "assistant", "content": draw(TEXT)},
        ]
    if draw(st.booleans()):
        out.append({"role": "user", "content": draw(TEXT)})
    return out


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(conversation=conversations(), words=st.sampled_from(["", "<|im_end|>", " naïve ✓"]))
def test_ids_and_answer_mask_equal_transformers(tokenizers, style, conversation, words):
    """ids are apply_chat_template's; the trained tokens are exactly its {% generation %} answer
    mask, for a template that renders earlier turns differently once later ones follow (qwen3)
    too."""
    ours, theirs = tokenizers[style]
    conversation[-1 if conversation[-1]["role"] == "assistant" else -2]["content"] += words
    ids, trained = ours.tokenize_conversation(conversation)
    want = theirs.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(want["input_ids"])
    assert [int(t) for t in trained] == list(want["assistant_masks"])
    assert any(trained)


def test_named_formats_render_megatrons_text_and_train_on_its_answers(tmp_path):
    """nemotron-h-aligned: System / User turns, the user turn opening the answer, each answer and
    its newline trained on; nemotron-nano-v2: the answer's own 'Assistant' header is not trained on,
    /think is dropped from the prompts; identity: the turns' texts joined, the answers trained on;
    the pad tokens are the formats'."""
    from tokenizers import Tokenizer

    directory = chat_tokenizer_dir(tmp_path, "chatml", template="")
    tok = Tokenizer.from_file(f"{directory}/tokenizer.json")
    tok.add_special_tokens(
        ["<unk>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]
    )
    tok.save(f"{directory}/tokenizer.json")
    conversation = [
        {"role": "system", "content": " be brief "},
        {"role": "user", "content": "f(x) /think"},
        {"role": "assistant", "content": "x * 3 "},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "the fox"},
    ]
    h = SFTTokenizer(directory, "nemotron-h-aligned")
    ids, trained = h.tokenize_conversation(conversation)
    assert h.decode(ids) == (
        "<SPECIAL_10>System\nbe brief\n<SPECIAL_11>User\nf(x) /think\n<SPECIAL_11>Assistant\nx * "
        "3\n<SPECIAL_11>User\nagain\n<SPECIAL_11>Assistant\nthe fox\n"
    )
    assert h.decode([i for i, t in zip(ids, trained) if t]) == "x * 3\nthe fox\n"
    assert h.pad == tok.token_to_id("<SPECIAL_233>")
    nano = SFTTokenizer(directory, "nemotron-nano-v2")
    ids, trained = nano.tokenize_conversation(conversation)
    assert nano.decode(ids) == (
        "<SPECIAL_10>System\nbe brief\n<SPECIAL_11>User\nf(x)\n<SPECIAL_11>Assistant\nx * "
        "3\n<SPECIAL_12>\n<SPECIAL_11>User\nagain\n<SPECIAL_11>Assistant\nthe fox\n<SPECIAL_12>\n"
    )
    assert (
        nano.decode([i for i, t in zip(ids, trained) if t])
        == "x * 3\n<SPECIAL_12>\nthe fox\n<SPECIAL_12>\n"
    )
    assert nano.pad == tok.token_to_id("<unk>")
    identity = SFTTokenizer(directory, "identity")
    ids, trained = identity.tokenize_conversation(conversation)
    assert identity.decode(ids) == " be brief f(x) /thinkx * 3 againthe fox"
    assert identity.decode([i for i, t in zip(ids, trained) if t]) == "x * 3 the fox"
    assert identity.pad == tok.token_to_id("<unk>")
    plain = chat_tokenizer_dir(tmp_path / "plain", "chatml")
    # no <unk>: the directory's pad token
    assert SFTTokenizer(plain, "identity").pad == SFTTokenizer(plain).pad
    with pytest.raises(ValueError, match="nemotron-h-aligned pads with <SPECIAL_233>"):
        SFTTokenizer(plain, "nemotron-h-aligned")
    with pytest.raises(ValueError, match="expected default"):
        SFTTokenizer(directory, "alpaca")


def test_a_line_splits_into_conversations_at_system_turns():
    a = random_conversation(random.Random(0), 2)
    b = random_conversation(random.Random(1), 1)
    c = random_conversation(random.Random(2), 1, system=False)
    assert line_conversations(json.dumps({"messages": a + b}).encode(), "x") == [a, b]
    assert line_conversations(json.dumps({"messages": c + a}).encode(), "x") == [c, a]


def corpus_of(tmp_path, tokenizer, lines):
    return sft_corpus(write_jsonl(tmp_path / "data.jsonl", lines), tokenizer, tmp_path / "cache")


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    seq_len=st.sampled_from([16, 32, 48]),
    cp=st.sampled_from([1, 2, 4]),
    packing=st.booleans(),
)
def test_samples_hold_their_conversations_as_documents(
    tmp_path_factory, tokenizers, seed, seq_len, cp, packing
):
    """Every sample: its documents are its conversations (each padded to 2 x cp at cp > 1) laid end
    to end, positions restart in each, the loss counts exactly the labels that are trained tokens of
    a conversation, and nothing is trained on beyond a cut; samples walk the lines (or packs) in
    order and start over."""
    ours = tokenizers["chatml"][0]
    rng = random.Random(seed)
    lines = [
        [random_conversation(rng, rng.randint(1, 2), words=3) for _ in range(rng.randint(1, 3))]
        for _ in range(rng.randint(1, 6))
    ]
    tmp_path = tmp_path_factory.mktemp("samples")
    corpus = corpus_of(tmp_path, ours, lines)
    granularity = 2 * cp if cp > 1 else 1
    data = SFTDataset(
        corpus,
        (0, corpus.num_lines),
        seq_len,
        2 * len(lines) + 1,
        pad=ours.pad,
        cp=cp,
        packing=packing,
    )
    groups = len(data.group_starts) - 1
    for i in range(len(data)):
        sample = data[i]
        first, last = (int(data.group_starts[i % groups + k]) for k in (0, 1))
        stream, flags, positions, starts = [], [], [], []
        # the definition: conversations end to end, each padded to the granularity
        for c in range(first, last):
            ids, extra = corpus.tokens[c].tolist(), -len(corpus.tokens[c]) % granularity
            starts.append(len(stream))
            stream += ids + [ours.pad] * extra
            flags += corpus.trained[c].tolist() + [0] * extra
            positions += list(range(len(ids) + extra))
        if len(stream) > seq_len:  # cut: position seq_len would only be a label; it becomes padding
            stream, flags, positions = (
                stream[:seq_len] + [ours.pad],
                flags[:seq_len] + [0],
                positions[: seq_len + 1],
            )
        else:
            more = seq_len + 1 - len(stream)
            positions += list(range(positions[-1] + 1, positions[-1] + 1 + more))
            stream, flags = stream + [ours.pad] * more, flags + [0] * more
        assert sample["tokens"].tolist() == stream[:-1] and sample["labels"].tolist() == stream[1:]
        assert sample["loss_mask"].tolist() == [float(f) for f in flags[1:]]
        assert sample["position_ids"].tolist() == positions[:-1]
        kept = [s for s in starts if s < seq_len]
        assert sample["cu_seqlens"].tolist() == [0, *kept[1:]] + [seq_len] * (
            seq_len + 1 - len(kept)
        )
        for a, b in zip(kept, kept[1:]):  # each document's positions restart at 0
            assert sample["position_ids"][a:b].tolist() == list(range(b - a))
    truncated = dropped = 0
    for g in range(min(groups, len(data))):
        lengths = corpus.tokens.sequence_lengths[
            data.group_starts[g] : data.group_starts[g + 1]
        ].astype(np.int64)
        t, d = fate(lengths, seq_len, granularity)
        truncated, dropped = truncated + t, dropped + d
    assert (data.truncated, data.dropped) == (truncated, dropped)
    if packing:
        assert dropped == 0


def test_pack_boundaries_and_fates():
    """Packs fill up to seq_len with padded lengths; a conversation survives whole when it ends by
    position s."""
    assert packs(np.array([5, 5, 5, 20, 3]), 10, 1).tolist() == [0, 2, 3, 4, 5]
    assert packs(np.array([5, 5, 5]), 10, 4).tolist() == [0, 1, 2, 3]  # 8 + 8 > 10
    assert fate(np.array([4, 6]), 10, 1) == (0, 0)
    assert fate(np.array([4, 7, 3]), 10, 1) == (1, 1)
    assert fate(np.array([10, 3]), 10, 1) == (0, 1)
    assert fate(np.array([3, 3]), 4, 4) == (0, 1)


def test_blend_and_split_and_the_cut_line(tmp_path, tokenizers):
    """--split divides each file's lines, a blend interleaves files by weight, and a split that cuts
    conversations says how many in one line."""
    ours = tokenizers["chatml"][0]
    rng = random.Random(0)
    a = write_jsonl(tmp_path / "a.jsonl", [[random_conversation(rng, 3)] for _ in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [[random_conversation(rng, 1)] for _ in range(20)])
    (train, valid, test), said = build_sft_datasets(
        f"30 {a} 70 {b}", "90,10,0", 24, [40, 8, 0], ours, cache_dir=tmp_path / "cache"
    )
    assert len(train) == 40 and len(valid) == 8 and test is None
    assert said and all("cut at --seq-length 24" in line for line in said)
    assert np.bincount(train.dataset_index).tolist() == [12, 28]  # 30:70, as build_datasets blends
    # 90% of each file's 20 lines
    assert [len(part.group_starts) - 1 for part in train.datasets] == [18, 18]
    assert [len(part.group_starts) - 1 for part in valid.datasets] == [2, 2]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json\n", "line 1: malformed JSON"),
        ('{"text": "x"}\n', 'line 1: expected {"messages"'),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}\n',
            "line 1: the conversation has no assistant turn",
        ),
        ('{"messages": [{"role": "bot", "content": "hi"}]}\n', "line 1: message 1 is not"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " '
            '"}]}\n',
            "empty assistant turn",
        ),
        (
            '\n{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, '
            '{"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}, {"role": '
            '"user", "content": "q"}]}\n',
            "line 2: conversation 2 has no assistant turn",
        ),
        ("", "no conversations"),
    ],
)
def test_a_damaged_file_names_its_line_and_leaves_nothing(tmp_path, tokenizers, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SFTDataError, match=needle.replace("{", "\\{").replace("(", "\\(")):
        sft_corpus(str(path), tokenizers["chatml"][0], tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


SFT_BAD = [
    (
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tok}"],
        "--sft needs --tokenizer-type SFTTokenizer",
    ),
    (["--tokenizer-type", "SFTTokenizer", "--tokenizer-model", "{plain}"], "has no chat template"),
    (
        [
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            "{tok}",
            "--sft-tokenizer-prompt-format",
            "alpaca",
        ],
        "--sft-tokenizer-prompt-format alpaca: expected default",
    ),
    (
        [
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            "{tok}",
            "--data-path",
            "{tmp}/missing.jsonl",
        ],
        "--data-path {tmp}/missing.jsonl: no such JSONL file",
    ),
    (
        [
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            "{tok}",
            "--data-path",
            "{tmp}/bad.jsonl",
        ],
        "bad.jsonl line 2: malformed JSON",
    ),
    (
        [
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            "{tok}",
            "--data-path",
            "{tmp}/unanswered.jsonl",
        ],
        "unanswered.jsonl line 1: the conversation has no assistant turn",
    ),
]


@pytest.mark.parametrize("flags, needle", SFT_BAD, ids=[needle[:40] for _, needle in SFT_BAD])
def test_bad_sft_input_is_one_line_exit_2_nothing_left(tmp_path, monkeypatch, flags, needle):
    from harness.bad_input import assert_one_line_exit_2_nothing_left

    tok, plain = (
        chat_tokenizer_dir(tmp_path, "chatml"),
        chat_tokenizer_dir(tmp_path, "llama3", template=""),
    )
    good = json.dumps({"messages": random_conversation(random.Random(0), 1)})
    (tmp_path / "bad.jsonl").write_text(good + "\n{oops\n")
    (tmp_path / "unanswered.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    (tmp_path / "good.jsonl").write_text(good + "\n")
    names = {"{tok}": tok, "{plain}": plain, "{tmp}": str(tmp_path)}

    def fill(text):
        for k, v in names.items():
            text = text.replace(k, v)
        return text

    argv = [
        "--sft",
        "--data-path",
        str(tmp_path / "good.jsonl"),
        "--train-iters",
        "1",
        *map(fill, flags),
    ]
    assert_one_line_exit_2_nothing_left(tmp_path, monkeypatch, "gpt_pretrain", argv, fill(needle))
    assert not list((tmp_path / ".cache").glob("sft-*"))


def test_sequence_packing_needs_sft(tmp_path, monkeypatch):
    from harness.bad_input import assert_one_line_exit_2_nothing_left

    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "gpt_pretrain",
        ["--sft-sequence-packing"],
        "--sft-sequence-packing packs conversations: it needs --sft",
    )


def test_bad_sft_input_stops_every_rank_with_one_line(tmp_path):
    """At 2 ranks one rank tokenizes and finds the damaged line; the other, waiting for the corpus,
    stops too."""
    import sys

    from harness.runner import run_group

    tok = chat_tokenizer_dir(tmp_path, "chatml")
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"messages": random_conversation(random.Random(0), 1)}) + "\n{oops\n"
    )
    out = run_group(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "recipes.gpt_pretrain",
            "--sft",
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            tok,
            "--data-path",
            str(tmp_path / "bad.jsonl"),
            "--data-cache-path",
            str(tmp_path / "cache"),
            "--tensor-model-parallel-size",
            "2",
        ],
        timeout=120,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert (
        out.returncode != 0 and len(errors) == 1 and "bad.jsonl line 2: malformed JSON" in errors[0]
    ), out.stderr
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        next((tmp_path / "cache").glob("*.failed")).name
    ]


def test_naming_the_default_format_says_that_the_answers_alone_are_trained_on():
    """Megatron's `default` format trains on every token; fmeg's trains on the answers, as every
    format, and says so."""
    from fmeg.config.arguments import parse_args

    notices = parse_args(
        ["--sft", "--sft-tokenizer-prompt-format", "default"], world_size=1
    ).notices
    assert any(
        n.startswith("--sft-tokenizer-prompt-format default: the loss counts the answers only")
        for n in notices
    )
    assert not any("prompt-format" in n for n in parse_args(["--sft"], world_size=1).notices)


def test_a_conversation_longer_than_the_sequence_is_cut_with_one_warning(tmp_path):
    """docs/fine-tuning.md's promise, as a run shows it: a conversation longer than --seq-length is
    cut, and the run says so in one warning line at start (with and without
    --sft-sequence-packing)."""
    from harness.runner import run_recipe

    tokenizer = chat_tokenizer_dir(tmp_path, "chatml")
    long = [
        {"role": "user", "content": "tell me " * 40},
        {"role": "assistant", "content": "ok " * 40},
    ]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [[long]] + [[short]] * 30)
    for packing in ([], ["--sft-sequence-packing"]):
        _, stdout = run_recipe(
            tmp_path,
            f"sft{len(packing)}",
            1,
            [
                "--sft",
                "--tokenizer-type",
                "SFTTokenizer",
                "--tokenizer-model",
                str(tokenizer),
                "--data-path",
                str(data),
                "--seq-length",
                "32",
                "--global-batch-size",
                "4",
                "--micro-batch-size",
                "2",
                "--train-iters",
                "2",
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "4",
                "--data-cache-path",
                str(tmp_path / "cache"),
                *packing,
            ],
            common=[],
        )
        said = [line for line in stdout.splitlines() if "cut at --seq-length 32" in line]
        assert len(said) == 1 and said[0].startswith(
            f"warning: --data-path {data}: 1 of the train split's"
        ), said
