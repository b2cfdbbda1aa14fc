"""The pipelined GPT has the single-device loss and gradients, for every schedule, with and without
virtual stages and tied embeddings, on gloo processes and on thread ranks."""

import pytest
import torch

from harness import spmd_programs as P
from fmeg import tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.spmd import run_threads
from harness.parallel import gloo

CONFIGS = {
    "gpt2_tied": gpt.GPTConfig.gpt2(
        vocab_size=48,
        max_seq_len=8,
        num_layers=8,
        hidden_size=16,
        num_heads=2,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "llama_untied": gpt.GPTConfig.llama(
        vocab_size=48,
        max_seq_len=8,
        num_layers=8,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=32,
    ),
}
# multi-token prediction on the last stage: its copy of the word embedding, tied (the output layer)
# or not
CONFIGS["llama_mtp"] = CONFIGS["llama_untied"].replace(
    mtp_num_layers=2, hidden_dropout=0.1, attention_dropout=0.1
)
CONFIGS["llama_tied_mtp"] = CONFIGS["llama_mtp"].replace(tie_embeddings=True, mtp_num_layers=1)


def microbatches(config, m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        t = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
        out.append(
            {
                "tokens": t[:, :-1],
                "labels": t[:, 1:],
                "loss_mask": (torch.rand(2, 8, generator=gen) > 0.2).float(),
                "dropout_key": torch.tensor(100 + i),
            }
        )
    return out


def check(results, config, params, mbs, pp, vp):
    want_loss, want = gp.reference_loss_and_grads(params, mbs, config)
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == 1
    torch.testing.assert_close(losses[0], want_loss, rtol=1e-6, atol=1e-6)
    stage_grads = {s: g for _, grads in results for s, g in grads.items()}
    assert sorted(stage_grads) == list(range(pp * vp))
    got = gp.merge(stage_grads, config)
    for (path, g), w in zip(tree.items(got), tree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=path)
    copy = gp.embedding_copy(config)
    if copy and pp * vp > 1:  # both copies got the same (summed) gradient
        owner, leaf = copy.split(".")
        torch.testing.assert_close(
            stage_grads[pp * vp - 1][owner][leaf], stage_grads[0]["embedding"]["word"]["weight"]
        )


CASES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("zero_bubble", 1),
    ("zero_bubble_v", 2),
    ("dualpipe_v", 2),
]


@pytest.mark.parametrize("schedule, vp", CASES)
@pytest.mark.parametrize("style", ["gpt2_tied", "llama_untied"])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipelined_gpt_on_gloo(schedule, vp, style, pp):
    # DualPipeV takes at least two microbatches per stage
    config, m = CONFIGS[style], 2 * pp if schedule == "dualpipe_v" else 4
    params, mbs = gpt.init(config, 0), microbatches(config, m)
    results = gloo(pp).run(P.pipelined_gpt, params, mbs, config, schedule, vp, pp=pp)
    check(results, config, params, mbs, pp, vp)


@pytest.mark.parametrize("schedule, vp", CASES + [("interleaved", 4)])
@pytest.mark.parametrize("segmented", [True, False])
def test_pipelined_gpt_on_thread_ranks(schedule, vp, segmented):
    config, pp, m = CONFIGS["gpt2_tied"], 2, 4
    params, mbs = gpt.init(config, 1), microbatches(config, m, seed=1)
    results = run_threads(pp, P.pipelined_gpt, params, mbs, config, schedule, vp, segmented, pp=pp)
    check(results, config, params, mbs, pp, vp)


@pytest.mark.parametrize("style", ["gpt2_tied", "llama_mtp"])
def test_one_stage_holds_both_copies_of_the_embedding(style):
    config = CONFIGS[style]
    params, mbs = gpt.init(config, 2), microbatches(config, 3, seed=2)
    results = run_threads(1, P.pipelined_gpt, params, mbs, config, "1f1b", 1, pp=1)
    check(results, config, params, mbs, 1, 1)


@pytest.mark.parametrize(
    "schedule, vp, pp",
    [("1f1b", 1, 2), ("interleaved", 2, 2), ("zero_bubble", 1, 4), ("zero_bubble_v", 2, 2)],
)
@pytest.mark.parametrize("style", ["llama_mtp", "llama_tied_mtp"])
def test_multi_token_prediction_on_the_last_stage_gives_one_devices_gradients(
    schedule, vp, pp, style
):
    config, m = CONFIGS[style], 4
    params, mbs = gpt.init(config, 3), microbatches(config, m, seed=3)
    results = run_threads(pp, P.pipelined_gpt, params, mbs, config, schedule, vp, pp=pp)
    check(results, config, params, mbs, pp, vp)
    assert "mtp" in gp.split(params, config, pp * vp)[pp * vp - 1]


def test_layers_must_divide_over_stages():
    with pytest.raises(
        ValueError, match=r"GPTConfig\.num_layers=8 must be divisible by the 3 pipeline stages"
    ):
        gp.split(gpt.init(CONFIGS["gpt2_tied"], 0), CONFIGS["gpt2_tied"], 3)
    with pytest.raises(ValueError, match=r"\[1, 2\] must be counts adding up to .*=8"):
        gp.split(gpt.init(CONFIGS["gpt2_tied"], 0), CONFIGS["gpt2_tied"], (1, 2))


# stages of 0, 1, 2 and 3 layers (8 in all), an empty stage between two full ones, the embedding
# alone on the first stage and the head alone on the last
UNEVEN = [
    ("1f1b", 1, 4, (3, 1, 0, 4)),
    ("gpipe", 1, 2, (0, 8)),
    ("zero_bubble", 1, 4, (2, 3, 3, 0)),
    ("interleaved", 2, 2, (0, 3, 2, 3)),
    ("interleaved", 2, 4, (0, 1, 2, 3, 0, 1, 1, 0)),
    ("zero_bubble_v", 2, 2, (0, 3, 5, 0)),
    ("dualpipe_v", 2, 2, (2, 0, 3, 3)),
]


@pytest.mark.parametrize("schedule, vp, pp, stage_layers", UNEVEN)
@pytest.mark.parametrize("style", ["gpt2_tied", "llama_mtp"])
def test_uneven_stages_give_one_devices_loss_and_gradients(schedule, vp, pp, stage_layers, style):
    config, m = CONFIGS[style], 4
    params, mbs = gpt.init(config, 4), microbatches(config, m, seed=4)
    results = run_threads(
        pp, P.pipelined_gpt, params, mbs, config, schedule, vp, True, stage_layers, pp=pp
    )
    check(results, config, params, mbs, pp, vp)
    held = {s: len(p["layers"]) for _, grads in results for s, p in grads.items()}
    assert tuple(held[s] for s in range(pp * vp)) == stage_layers


def test_uneven_stages_on_gloo():
    config, pp, vp, stage_layers = CONFIGS["llama_untied"], 2, 2, (0, 3, 5, 0)
    params, mbs = gpt.init(config, 5), microbatches(config, 4, seed=5)
    results = gloo(pp).run(
        P.pipelined_gpt, params, mbs, config, "interleaved", vp, True, stage_layers, pp=pp
    )
    check(results, config, params, mbs, pp, vp)


def test_uneven_stage_offsets_follow_megatron():
    config = CONFIGS["gpt2_tied"].replace(num_layers=9)
    # stage s = chunk * pp + rank; each stage starts after the layers of the stages before it
    counts = (0, 2, 3, 1, 0, 3)
    assert [list(gp.stage_layers(config, s, counts)) for s in range(6)] == [
        [],
        [0, 1],
        [2, 3, 4],
        [5],
        [],
        [6, 7, 8],
    ]


def test_stage_offsets_follow_megatron():
    config = CONFIGS["gpt2_tied"].replace(num_layers=16)
    # PP=4, VP=2, 16 layers: rank 0 holds layers 0-1 and 8-9, rank 1 holds 2-3 and 10-11 (0-based).
    assert [list(gp.stage_layers(config, s, 8)) for s in (0, 4, 1, 5)] == [
        [0, 1],
        [8, 9],
        [2, 3],
        [10, 11],
    ]
