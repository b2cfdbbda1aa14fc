"""Waiting on processes the tests start (wait_for)."""

import time


def wait_for(proc, words, timeout=400):
    """Read stdout until a line holds words; the lines read."""
    seen, end = [], time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if words in line or time.monotonic() > end:
            break
    return seen
