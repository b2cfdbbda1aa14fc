"""Megatron's --pipeline-model-parallel-layout: the strings of its documentation expand as it
expands them, an even layout sets the virtual stages as --num-layers-per-virtual-pipeline-stage
would, an uneven one gives each stage its layers, and a layout fmeg's pipeline cannot hold is one
line naming why."""

import pytest

from fmeg.config.arguments import parse_args
from fmeg.parallel.pipeline.stage_layers import expand, stages
from fmeg.config.validation import validate


def test_megatrons_examples_expand_as_documented():
    # DeepSeek-V3 at pp 16 x vpp 2
    assert stages("Et*3|(tt|)*29,m|L") == ["Ettt", *["tt"] * 29, "m", "L"]
    assert stages("E||t|L") == ["E", "", "t", "L"]  # an empty stage
    assert expand("E|(t|)*3,m|m||L") == "E|t|t|t|m|m||L"
    assert expand("Et*2|(tt|)*22t|(tt|)*7mL").count("t") == 61
    assert expand("((t|)*2t)*2") == "t|t|tt|t|t"


def args(layout, pp=2, layers=4, mtp=1, extra=()):
    return parse_args(
        [
            "--num-layers",
            str(layers),
            "--pipeline-model-parallel-size",
            str(pp),
            "--pipeline-model-parallel-layout",
            layout,
            "--position-embedding-type",
            "rope",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "1",
            *(["--mtp-num-layers", str(mtp)] if mtp else []),
            *extra,
        ],
        world_size=pp,
    )


@pytest.mark.parametrize(
    "layout, per_stage", [("Et|t|t|tmL", 1), ("Ett|ttmL", None), ("Et,t|(t)*2,m,L", None)]
)
def test_an_even_layout_sets_the_virtual_stages(layout, per_stage):
    a = args(layout)
    assert validate(a, 2) == [] and a.num_layers_per_virtual_pipeline_stage == per_stage


@pytest.mark.parametrize(
    "layout, needle",
    [
        ("Ett|t|tmL", "3 stages are not a multiple of --pipeline-model-parallel-size 2"),
        ("Ett|tt|m|L", "keeps the MTP layers (m) and the loss (L) at the end of the last stage"),
        ("Et|t|t|t|m|L|E|L", "it holds 2 E, 4 t, 1 m and 2 L"),
        ("Et*3|(tt|)*29,m|L", "it holds 1 E, 61 t"),
        ("tE|tttmL", "the embedding (E) comes first in the first stage"),
        ("|Ett|tt|mL", "the embedding (E) comes first in the first stage"),
        ("Et|tm|t|tL", "keeps the MTP layers (m) and the loss (L) at the end of the last stage"),
        ("Et|t|(t|tmL", "a '(' is not closed"),
        ("Et|t|t|tmLx", "cannot read 'x'"),
    ],
)
def test_other_layouts_are_one_line_naming_what_differs(layout, needle):
    problems = validate(args(layout), 2)
    assert len(problems) == 1 and problems[0].startswith(
        f"--pipeline-model-parallel-layout {layout!r}: "
    )
    assert needle in problems[0]


def test_the_layout_and_the_virtual_stage_flag_are_alternatives():
    problems = validate(
        args("Et|t|t|tmL", extra=["--num-layers-per-virtual-pipeline-stage", "1"]), 2
    )
    assert problems == [
        "--pipeline-model-parallel-layout places every layer: drop "
        "--num-layers-per-virtual-pipeline-stage, --decoder-first/last-pipeline-num-layers and "
        "--account-for-*-in-pipeline-split"
    ]


@pytest.mark.parametrize(
    "layout, pp, counts",
    [
        ("Ettt|tmL", 2, (3, 1)),
        ("E|t|ttt|mL", 2, (0, 1, 3, 0)),
        ("E||tt|tt|mL|", 2, None),
        ("E|t|tt||t|mL", 3, (0, 1, 2, 0, 1, 0)),
    ],
)
def test_an_uneven_layout_gives_each_stage_its_layers(layout, pp, counts):
    a = args(layout, pp=pp)
    problems = validate(a, pp)
    if counts is None:  # the loss is not at the end of the last stage
        assert len(problems) == 1 and "at the end of the last stage" in problems[0]
        return
    assert problems == [] and a.pipeline_stage_layers == counts
    assert a.num_layers_per_virtual_pipeline_stage is None
