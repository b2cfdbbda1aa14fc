"""The flag sets of Megatron-LM main's GPT training configurations and example scripts (data
captured by tests/fixtures/megatron_flags/capture.py), as command lines."""

from __future__ import annotations

import json
import re

from harness.paths import FIXTURES

FLAG_SETS = json.loads((FIXTURES / "megatron_flags" / "flag_sets.json").read_text())
CONFIGS, SCRIPTS = FLAG_SETS["functional_tests"], FLAG_SETS["examples"]


def argv_of(flags: dict[str, str]) -> list[str]:
    """A configuration's MODEL_ARGS as Megatron's CI passes them: true as the bare switch, [a b] as
    values; its ${VARIABLES} stand for paths (a seed for ${REPEAT})."""
    out = []
    for flag, value in flags.items():
        if value == "True":
            out.append(flag)
            continue
        value = re.sub(r"\$\{?[A-Z_]+\}?", "/data", re.sub(r"\$\{?REPEAT\}?", "1", value))
        many = (
            value.startswith("[")
            and value.endswith("]")
            or flag == "--hierarchical-context-parallel-sizes"
        )
        out += [flag, *value.strip("[]").split()] if many else [flag, value]
    return out
