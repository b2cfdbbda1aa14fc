"""docs/flags.md from the runner's parser: every flag once, by group, with its default, its choices
and what it does (for a flag accepted from Megatron and ignored, why).

    python -m fmeg.config.flags_doc > docs/flags.md
"""

from __future__ import annotations

import argparse

from fmeg.config import fsdp_flags, megatron_flags, mla_flags, modelopt_flags, moe_flags
from fmeg.config.arguments import build_parser

HEADER = """# The runner's flags

`torchrun --nproc-per-node N -m recipes.gpt_pretrain [flags]` takes Megatron-LM's flags under their
names and defaults. This page is generated from the parser (`python -m fmeg.config.flags_doc >
docs/flags.md`; a test keeps it current). A flag in the last two groups is accepted so that
Megatron's scripts run as written: its 'off' value only (a feature fmeg does not have yet), or
ignored, named in the start line with the reason given here.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "off" if action.default in (False, None) else "on"
    return "" if action.default is None else f"`{action.default}`"


# The flags hidden from --help that no table of ignored or refused flags names: fmeg's own, which
# --use-checkpoint-args sets from an imported model.
CARRIED = (
    "set by --use-checkpoint-args from an imported model's routing or YaRN rule; not a flag to give"
)


def _reasons() -> dict[str, str]:
    """{flag: why} of every flag the flag modules' tables ignore or refuse."""
    out: dict[str, str] = {}
    tables = [
        megatron_flags.IGNORED_SWITCHES,
        megatron_flags.IGNORED_SETTINGS,
        moe_flags.IGNORED,
        moe_flags.IGNORED_SETTINGS,
        mla_flags.IGNORED,
        fsdp_flags.IGNORED,
        modelopt_flags.IGNORED,
    ]
    for table in tables:
        for flag, value in table.items():
            why = value if isinstance(value, str) else next(v for v in value if isinstance(v, str))
            out[flag] = f"ignored: {why}"
    for flag, value in modelopt_flags.REFUSED.items():
        feature, fix = value[-2], value[-1]
        out[flag] = f"its default only: {feature}; {fix}"
    return out


def _meaning(action: argparse.Action, reasons: dict[str, str]) -> str:
    flag = action.option_strings[0]
    if action.help == argparse.SUPPRESS:
        return reasons.get(flag, CARRIED)
    text = action.help or ""
    if action.choices is not None:
        text = f"{text} (one of: {', '.join(str(c) for c in action.choices)})".strip()
    return text


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The page: one table per argument group, a row per flag."""
    parser = parser or build_parser()
    out, reasons = [HEADER], _reasons()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)
        ]
        if not actions:
            continue
        out += [f"\n## {group.title}\n", "| flag | default | what it does |", "|---|---|---|"]
        for a in actions:
            names = ", ".join(f"`{name}`" for name in a.option_strings)
            out.append(f"| {names} | {_cell(_default(a))} | {_cell(_meaning(a, reasons))} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
