"""docs/flags.md is the parser's: the command it names prints it as it is, every flag has exactly
one row, and every row says what the flag does."""

import re
import subprocess
import sys

from fmeg.config.arguments import build_parser
from harness.paths import ROOT

DOC = ROOT / "docs" / "flags.md"


def test_the_page_is_what_its_command_prints():
    out = subprocess.run(
        [sys.executable, "-m", "fmeg.config.flags_doc"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out == DOC.read_text(), (
        "docs/flags.md is stale: python -m fmeg.config.flags_doc > docs/flags.md"
    )


def test_every_flag_has_one_row_that_says_what_it_does():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `--")]
    flags = [re.findall(r"`(--[A-Za-z0-9_-]+)`", row.split(" | ")[0]) for row in rows]
    named = [f for names in flags for f in names]
    parser_flags = [
        o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")
    ]
    assert sorted(named) == sorted(set(parser_flags) - {"--help"})
    assert len(named) == len(set(named)), "a flag in two rows"
    empty = [row for row in rows if not row.rstrip(" |").rsplit(" | ", 1)[-1].strip()]
    assert empty == [], empty
