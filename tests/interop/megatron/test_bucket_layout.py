"""Which decoder layers each pipeline rank's model chunk holds, as fmeg places a Megatron
checkpoint's bucketed optimizer state: megatron-core's own get_transformer_layer_offset and
get_num_layers_to_build (its TransformerConfig's uneven-split fields, its
PipelineParallelLayerLayout) say the same for every split Megatron accepts."""

import argparse

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: E402
    PipelineParallelLayerLayout,
)
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

from fmeg.interop.megatron.bucket_layout import _layers  # noqa: E402


def megatrons(cfg: TransformerConfig, pp: int, vp: int | None) -> dict:
    """{(pp rank, chunk): its layers} by megatron-core's functions."""
    out = {}
    for p in range(pp):
        for c in range(vp or 1):
            stage = c if vp else None
            offset = get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=p)
            out[(p, c)] = range(offset, offset + get_num_layers_to_build(cfg, stage, p))
    return out


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 16),
    pp=st.integers(2, 4),
    vp=st.sampled_from([None, 2, 3]),
    first=st.sampled_from([None, 1, 2, 4]),
    last=st.sampled_from([None, 1, 3]),
    embedding=st.booleans(),
    loss=st.booleans(),
)
def test_uneven_flags_give_megatron_cores_layers(layers, pp, vp, first, last, embedding, loss):
    try:
        cfg = TransformerConfig(
            num_layers=layers,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
            pipeline_dtype=torch.float32,
        )
        want = megatrons(cfg, pp, vp)
    except (ValueError, AssertionError):
        assume(False)
    # megatron-core's config takes some splits its functions then give negative counts for
    # (Megatron-LM's argument checks refuse them)
    assume(all(len(r) == r.stop - r.start >= 0 for r in want.values()))
    assume(sum(len(r) for r in want.values()) == layers)
    args = argparse.Namespace(
        num_layers=layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss,
    )
    assert {k: _layers(args, *k) for k in want} == want


@pytest.mark.parametrize(
    "layout, layers, pp, vp",
    [
        ("Et|tt|t|tL", 5, 2, 2),
        ("Ettt|tL", 4, 2, None),
        ("E|t*3|tt|L", 5, 2, 2),
        ("Et*2|(t|)*2L", 4, 2, 2),
        ("Et|(tt|)*3,t|tL", 9, 3, 2),
    ],
)
def test_layout_strings_give_megatron_cores_layers(layout, layers, pp, vp, monkeypatch):
    # its layout reads the virtual stages' count from its parallel state
    monkeypatch.setattr(
        parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vp
    )
    parsed = PipelineParallelLayerLayout(layout, pp)
    want = {}
    for p in range(pp):
        for c in range(vp or 1):
            offset = parsed.get_layer_offset(LayerType.decoder, vp_stage=c, pp_rank=p)
            count = parsed.get_num_layers_to_build(LayerType.decoder, vp_stage=c, pp_rank=p)
            want[(p, c)] = range(offset, offset + count)
    args = argparse.Namespace(
        num_layers=layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_model_parallel_layout=layout,
    )
    assert {k: _layers(args, *k) for k in want} == want
