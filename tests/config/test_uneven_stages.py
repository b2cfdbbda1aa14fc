"""Uneven pipeline stages place each layer where megatron-core places it: for
--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split and the
virtual stages (hypothesis), and for layout strings (DeepSeek-V3's included), each stage's decoder
layers and its first layer's index equal megatron-core's get_num_layers_to_build and layer offset,
and what megatron-core refuses fmeg refuses in one line."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.config.arguments import parse_args
from fmeg.parallel.pipeline.stage_layers import flag_stage_layers, layout_stage_layers
from fmeg.config.validation import validate

pytest.importorskip("megatron.core.transformer.transformer_layer")


def megatron_stages(num_layers, pp, vp, first, last, embedding, loss):
    """{stage: (layers, offset)} from megatron-core, stage = virtual stage * pp + rank; None when
    its TransformerConfig refuses the split."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = TransformerConfig(
                num_layers=num_layers,
                hidden_size=16,
                num_attention_heads=4,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                num_layers_in_first_pipeline_stage=first,
                num_layers_in_last_pipeline_stage=last,
                account_for_embedding_in_pipeline_split=embedding,
                account_for_loss_in_pipeline_split=loss,
                pipeline_dtype=torch.float32,
            )
            return {
                v * pp + r: (
                    get_num_layers_to_build(config, v if vp > 1 else None, r),
                    get_transformer_layer_offset(config, v if vp > 1 else None, r),
                )
                for v in range(vp)
                for r in range(pp)
            }
        except (AssertionError, ValueError):
            return None


def with_offsets(counts):
    return {s: (n, sum(counts[:s])) for s, n in enumerate(counts)}


@settings(max_examples=150, deadline=None)
@given(
    num_layers=st.integers(1, 24),
    pp=st.integers(2, 5),
    vp=st.integers(1, 3),
    first=st.none() | st.integers(0, 8),
    last=st.none() | st.integers(0, 8),
    ends=st.booleans(),
    embedding=st.booleans(),
    loss=st.booleans(),
)
def test_the_split_flags_place_layers_as_megatron_core_does(
    num_layers, pp, vp, first, last, ends, embedding, loss
):
    if ends:  # the first/last counts, or the embedding and loss: Megatron's alternatives
        embedding = loss = False
    else:
        first = last = None
    want = megatron_stages(num_layers, pp, vp, first, last, embedding, loss)
    try:
        got = with_offsets(flag_stage_layers(num_layers, pp, vp, first, last, embedding, loss))
    except ValueError:
        got = None
    if want is not None and any(n < 0 for n, _ in want.values()):
        want = None  # megatron-core builds a negative number of layers: no split at all
    if want is not None and sum(n for n, _ in want.values()) != num_layers:
        want = None  # megatron-core loses or repeats layers: no split at all
    assert got == want


@pytest.mark.parametrize(
    "layout, pp",
    [
        ("Et*2|(tt|)*22t|(tt|)*7mL", 16),
        ("Et*2|(tt|)*22t|(tt|)*7mL", 4),
        ("E|t|tt|ttt||t|tt|mL", 4),
        ("E|t|tt|ttt||t|tt|mL", 2),
        ("Ettt|tmL", 2),
    ],
)
def test_layout_strings_place_layers_as_megatron_core_does(layout, pp, monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    mc = PipelineParallelLayerLayout(layout, pp)
    vp = mc.virtual_pipeline_model_parallel_size
    monkeypatch.setattr(parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", vp)
    want = {
        v * pp + r: (
            mc.get_num_layers_to_build(vp_stage=v, pp_rank=r),
            mc.get_layer_offset(vp_stage=v, pp_rank=r),
        )
        for v in range(vp)
        for r in range(pp)
    }
    mtp = layout.count("m")
    layers = sum(n for n, _ in want.values())
    assert with_offsets(layout_stage_layers(layout, layers, mtp, pp)) == want


def args(*flags, layers=8, pp=4):
    return parse_args(
        [
            "--num-layers",
            str(layers),
            "--pipeline-model-parallel-size",
            str(pp),
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "1",
            *flags,
        ],
        world_size=pp,
    )


@pytest.mark.parametrize(
    "flags, counts",
    [
        (
            ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
            (1, 3, 3, 1),
        ),
        (
            [
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-layers",
                "14",
            ],
            (1, 2, 2, 2, 2, 2, 2, 1),
        ),
        (
            [
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-layers",
                "6",
            ],
            (0, 1, 1, 1, 1, 1, 1, 0),
        ),
        (["--decoder-last-pipeline-num-layers", "2"], (2, 2, 2, 2)),
    ],
)
def test_the_flags_set_the_stages(flags, counts):
    a = args(*flags)
    assert validate(a, 4) == []
    if len(set(counts)) == 1:  # even: the virtual stages as before
        assert a.pipeline_stage_layers is None
    else:
        assert a.pipeline_stage_layers == counts


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--decoder-first-pipeline-num-layers", "3"],
            "--decoder-first-pipeline-num-layers 3: the 5 layers left do not split evenly over "
            "the 3 pipeline ranks between the first and the last",
        ),
        (
            ["--decoder-first-pipeline-num-layers", "2", "--account-for-loss-in-pipeline-split"],
            "--decoder-first-pipeline-num-layers 2 --account-for-loss-in-pipeline-split: "
            "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split are "
            "alternatives",
        ),
        (
            [
                "--decoder-first-pipeline-num-layers",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            "--decoder-first-pipeline-num-layers 2: give the virtual stages with "
            "--num-virtual-stages-per-pipeline-rank",
        ),
        (
            ["--account-for-embedding-in-pipeline-split"],
            "--account-for-embedding-in-pipeline-split: the 8 layers + embedding = 9 do not "
            "split evenly over --pipeline-model-parallel-size 4",
        ),
        (
            [
                "--pipeline-model-parallel-layout",
                "E|tt|tt|ttttL",
                "--decoder-first-pipeline-num-layers",
                "0",
            ],
            "--pipeline-model-parallel-layout places every layer: drop",
        ),
    ],
)
def test_a_split_megatron_refuses_is_one_line(flags, line):
    problems = validate(args(*flags), 4)
    assert len(problems) == 1 and problems[0].startswith(line), problems
