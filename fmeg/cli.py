"""The command-line parser every fmeg command uses: Megatron's rules (no prefix of a flag is taken
for it), help printed by rank 0 only under torchrun, each error line printed once per job
(print_refusal), and a usage error as one line naming the flag (with the closest flag when there is
one) and a pointer to --help, exit 2, instead of the usage text.

    p = OneLineParser(prog="python -m recipes.generate")
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import sys
from typing import Any


# a directory fmeg.launch makes, shared by its workers
REFUSALS = "FMEG_REFUSALS"


def print_refusal(lines: list[str] | tuple[str, ...]) -> None:
    """'error: line' on stderr for each line, once per job. Under fmeg.launch the rank that reaches
    a line first prints it (a file named by the line's hash, made exclusively in $FMEG_REFUSALS,
    says it was), so a refusal is printed however the ranks race to exit, and whichever rank alone
    met it; elsewhere rank 0 prints."""
    shared = os.environ.get(REFUSALS)
    for line in lines:
        if shared:
            try:
                os.close(
                    os.open(
                        os.path.join(shared, hashlib.sha1(line.encode()).hexdigest()),
                        os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                    )
                )
            except FileExistsError:
                continue
            # the directory is gone: say it anyway
            except OSError:
                pass
        elif os.environ.get("RANK", "0") != "0":
            continue
        print(f"error: {line}", file=sys.stderr, flush=True)


def refuse(message: str) -> None:
    """One line on stderr (print_refusal) and exit 2."""
    print_refusal([message])
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str):
        refuse(f"{one_line(message, self._actions)}; see --help")


def one_line(message: str, actions) -> str:
    """argparse's error message, with an unrecognized flag named alone and its closest known
    flag."""
    if message.startswith("unrecognized arguments: "):
        unknown = message.removeprefix("unrecognized arguments: ").split()
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        known = [o for action in actions for o in action.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1)
        return f"unrecognized argument {flag}" + (f" (did you mean {close[0]}?)" if close else "")
    return message
