"""Layout invariance of --sft with Megatron's default dropout: a Llama-style model fine-tuned on
JSONL conversations (one to two per line, each its own document, trained on its answers) gives one
rank's loss curve within 1e-5 over 20 iterations at tp 2 + sp, cp 2, pp 2 with virtual stages, dp 2
with the distributed optimizer, and with --sft-sequence-packing at tp 2 and dp 2.

Each conversation here is a multiple of 4 tokens long, so cp 2's padding to 2 x cp (Megatron's) adds
none: with padding, a line's second conversation moves along the row, and dropout, which is drawn by
position, draws differently (as in Megatron). The padded case is its own row, without dropout."""

from __future__ import annotations

import random

import pytest

from harness.chat_data import chat_tokenizer_dir, random_conversation, write_jsonl
from harness.runner import DROPOUT, run_recipe
from harness import layouts

LLAMA = [
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
]
# the rest are -m slow (packed documents at cp 2 run by default in test_document_layouts)
LAYOUTS = layouts.rows(
    ["tp2_sp", "cp2", "pp2_virtual", "dp2_zero1", "packed_tp2", "packed_dp2_zero1"],
    fast=("tp2_sp",),
)


def conversations(tokenizer, rng: random.Random, multiple: int) -> list[dict]:
    """A random conversation whose tokens (its closing end of document included) are a multiple of
    `multiple`."""
    conversation = random_conversation(rng, 1, words=2)
    while (len(tokenizer.tokenize_conversation(conversation)[0]) + 1) % multiple:
        conversation[0]["content"] += " x"
    return conversation


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(the tokenizer and data flags for 4-aligned conversations, the same for unaligned ones)."""
    from fmeg.data.sft_tokenizer import SFTTokenizer

    root = tmp_path_factory.mktemp("sft_layouts")
    directory = chat_tokenizer_dir(root, "chatml")
    tokenizer, rng = SFTTokenizer(directory), random.Random(0)
    flags = []
    for name, multiple in (("aligned", 4), ("any", 1)):
        lines = [
            [conversations(tokenizer, rng, multiple) for _ in range(rng.randint(1, 2))]
            for _ in range(200)
        ]
        flags.append(
            [
                "--sft",
                "--tokenizer-type",
                "SFTTokenizer",
                "--tokenizer-model",
                directory,
                "--data-path",
                write_jsonl(root / f"{name}.jsonl", lines),
                "--data-cache-path",
                str(root / "cache"),
            ]
        )
    return flags


def curve(tmp_path, name, nproc, flags):
    records, stdout = run_recipe(tmp_path, name, nproc, [*LLAMA, *flags])
    # every line fits: the layouts hold the same conversations
    assert "cut at --seq-length" not in stdout
    return [r["lm_loss"] for r in records if "lm_loss" in r]


def assert_same(got, want):
    assert len(got) == len(want) == 20 and min(want) > 0
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat):
    """One rank's curve, with or without --sft-sequence-packing (each run once, when first asked
    for)."""
    root, curves = tmp_path_factory.mktemp("sft_reference"), {}

    def of(packing: tuple[str, ...]):
        if packing not in curves:
            curves[packing] = curve(
                root, f"single{len(packing)}", 1, [*chat[0], *DROPOUT, *packing]
            )
        return curves[packing]

    return of


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_sft_curves_are_layout_invariant(tmp_path, chat, reference, name, nproc, flags):
    packing = ("--sft-sequence-packing",) if "--sft-sequence-packing" in flags else ()
    assert_same(curve(tmp_path, name, nproc, [*chat[0], *DROPOUT, *flags]), reference(packing))


@pytest.mark.slow
def test_sft_padding_for_context_parallelism_changes_no_loss(tmp_path, chat):
    """Conversations of any length, padded to multiples of 4 at cp 2 and not at one rank: the same
    curve."""
    one = curve(tmp_path, "any_single", 1, chat[1])
    assert_same(curve(tmp_path, "any_cp2", 2, [*chat[1], "--context-parallel-size", "2"]), one)


# Experts with both balance losses: their padded tokens are routed but left out of the losses
# (megatron-core's padding_mask), so the losses, like the LM loss, do not depend on how much padding
# a layout adds.
EXPERTS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
]


def moe_curves(tmp_path, name, nproc, flags) -> dict[str, list[float]]:
    records, _ = run_recipe(tmp_path, name, nproc, [*LLAMA, *EXPERTS, *flags])
    train = [r for r in records if "lm_loss" in r]
    return {k: [r[k] for r in train] for k in ("lm_loss", "seq_load_balancing_loss", "z_loss")}


# the padding's semantics are checked against megatron-core's router in
# tests/models/test_moe_padding.py
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, flags",
    [
        ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("cp2", ["--context-parallel-size", "2"]),
    ],
)
def test_sft_experts_leave_padding_out_of_their_balance_losses_at_any_layout(
    tmp_path, chat, name, flags
):
    """Conversations of any length (rows end in padding; cp 2 pads each conversation to a multiple
    of 4 as well): the LM loss and both balance losses follow one rank's curve."""
    one = moe_curves(tmp_path, "single", 1, chat[1])
    other = moe_curves(tmp_path, name, 2, [*chat[1], *flags])
    for key in one:
        assert_same(other[key], one[key])
