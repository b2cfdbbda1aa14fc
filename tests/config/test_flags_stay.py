"""recipes.gpt_pretrain's flags as users know them stay: every flag of the parser before issue 50's
redesign (tests/fixtures/flags_before_redesign.json) is still there, under the same names, with the
same default, choices, number of values and kind, shown in --help or hidden as before. New flags may
join.

    # the snapshot, taken once before the redesign
    python tests/config/test_flags_stay.py --write
"""

import argparse
import json
import sys
from harness.paths import FIXTURES

SNAPSHOT = FIXTURES / "flags_before_redesign.json"


def describe(parser: argparse.ArgumentParser) -> dict:
    """{flag: what a user sees of it} for each option of the parser."""
    out = {}
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        out[a.option_strings[0]] = {
            "aliases": a.option_strings[1:],
            "dest": a.dest,
            "switch": a.nargs == 0,
            "default": a.default,
            "choices": None if a.choices is None else list(a.choices),
            "nargs": a.nargs,
            "type": getattr(a.type, "__name__", None) if a.type in (int, float) else None,
            "shown": a.help != argparse.SUPPRESS,
        }
    return out


def current() -> dict:
    from fmeg.config.arguments import build_parser

    # as JSON gives it back: tuples as lists
    return json.loads(json.dumps(describe(build_parser())))


# accepted and ignored before (hidden, no default), honoured since with Megatron's defaults, shown
# in --help: Muon's (issue 52), FP8's (issue 53), --deterministic-mode (issue 69)
HONOURED_SINCE = {
    "--muon-momentum",
    "--muon-scale-mode",
    "--muon-extra-scale-factor",
    "--fp8-recipe",
    "--fp8-margin",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--fp8-param-gather",
    "--first-last-layers-bf16",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--deterministic-mode",
}
# --fp8-format was refused at any value but its default; since issue 53 it runs, under Megatron's
# dest (args.fp8), which Megatron's saved arguments use
RENAMED_DEST = {"--fp8-format": "fp8"}


def widened(was: dict, now: dict) -> bool:
    """Only new choices were added (every old value still means what it meant): e.g.
    --pipeline-schedule's zero_bubble_v and dualpipe_v (issue 54)."""
    old, new = was.get("choices"), now.get("choices")
    same_otherwise = {k: v for k, v in was.items() if k != "choices"} == {
        k: v for k, v in now.items() if k != "choices"
    }
    return bool(old and new and same_otherwise and new[: len(old)] == old)


def test_every_flag_from_before_the_redesign_is_there_as_it_was():
    before, now = json.loads(SNAPSHOT.read_text()), current()
    missing = sorted(set(before) - set(now))
    assert not missing, f"flags gone: {missing}"
    for flag, dest in RENAMED_DEST.items():
        assert now[flag]["dest"] == dest
        now[flag] = {**now[flag], "dest": before[flag]["dest"]}
    changed = {
        flag: (was, now[flag])
        for flag, was in before.items()
        if now[flag] != was
        and not (flag in HONOURED_SINCE and not was["shown"])
        and not widened(was, now[flag])
    }
    assert not changed, "\n".join(f"{f}: {a} -> {b}" for f, (a, b) in sorted(changed.items()))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}: {len(current())} flags")
