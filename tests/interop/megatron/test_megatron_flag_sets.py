"""Every flag of Megatron-LM main's GPT training configurations (the 221 functional tests that
train) and of its example scripts that launch pretrain_gpt.py is one fmeg's parser knows. Each is
honoured, named at start as ignored with its reason, or, for the features still to come named below,
refused in one line naming the feature. The flag sets are data captured from Megatron-LM main
(tests/fixtures/megatron_flags/capture.py). The scripts themselves run with their flags in
tests/interop/megatron/test_megatron_scripts.py."""

import contextlib
import io

import pytest

from fmeg.config.arguments import build_parser, parse_args
from fmeg.config.megatron_flags import IGNORED_SETTINGS, IGNORED_SWITCHES, LATER_WORK, ignored_flags
from fmeg.config.validation import validate

from harness.megatron_flag_sets import CONFIGS, SCRIPTS, argv_of

# the flags these configurations and scripts use that ask for a feature fmeg does not have yet
STILL_TO_COME = {
    "--experimental-attention-variant": "gated delta net and DeepSeek sparse attention",
    "--attention-output-gate": "Qwen3-Next's gated attention",
    # used only by the gated delta net configurations
    "--apply-wd-to-qk-layernorm": "weight decay on the q/k norms",
    "--use-mup": "muP",
    "--rotary-interleaved": "Llama 4's interleaved rotary embeddings",
    "--per-split-data-args-path": "a data path per split",
}


def test_there_are_the_flag_sets_of_megatron_lm_main():
    assert len(CONFIGS) >= 200 and len(SCRIPTS) >= 8
    assert "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh" in SCRIPTS
    assert (
        "--fsdp-manual-registration"
        in SCRIPTS["examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh"]
    )


def test_every_flag_is_one_fmeg_knows():
    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    unknown = {
        f"{name}: {flag}"
        for name, flags in {**CONFIGS, **SCRIPTS}.items()
        for flag in flags
        if flag not in known
    }
    assert not unknown, sorted(unknown)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_configuration_parses_and_names_what_it_ignores(name):
    """Values as the configuration gives them (choices, numbers, lists); each ignored flag it gives
    is named at start with its reason."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv_of(CONFIGS[name]))
    except SystemExit:
        pytest.fail(err.getvalue())
    named = {line.split(":")[0] for line in ignored_flags(args)}
    given_ignored = {
        flag for flag in CONFIGS[name] if flag in IGNORED_SWITCHES or flag in IGNORED_SETTINGS
    }
    assert given_ignored <= named, given_ignored - named


def test_the_flags_refused_are_the_features_still_to_come():
    used = {flag for flags in CONFIGS.values() for flag in flags} | {
        f for flags in SCRIPTS.values() for f in flags
    }
    assert used & set(LATER_WORK) == set(STILL_TO_COME)


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--attention-output-gate"],
            "--attention-output-gate: a gate on attention's output (Qwen3-Next's) is not "
            "supported by fmeg yet",
        ),
        (
            ["--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "4"],
            "--experimental-attention-variant gated_delta_net: Megatron's experimental attention",
        ),
    ],
)
def test_a_feature_still_to_come_is_refused_alone_in_one_line(flags, line):
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
    problems = validate(parse_args(base + flags, world_size=1), 1)
    assert len(problems) == 1 and problems[0].startswith(line), problems
