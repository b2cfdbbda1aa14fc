"""Actions: what one pipeline rank does next, written as PyTorch's pipelining writes them ("2F0").

A schedule is a list per pipeline rank of Actions in execution order. Stages are virtual: with v
model chunks per rank and pp ranks, stage s = chunk * pp + rank lives on rank s % pp (Megatron's
interleaving), and the model's layers run through stages 0, 1, ..., v * pp - 1 in order.

    F   forward of one microbatch through one stage
    B   backward (input gradient; the weight gradient too unless a W for it follows)
    W   weight gradient (zero-bubble schedules)
    SEND_F / RECV_F   the activation from stage s to stage s + 1
    SEND_B / RECV_B   the gradient from stage s to stage s - 1
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMPUTE = ("F", "B", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_PATTERN = re.compile(r"^(\d+)(F|B|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMMUNICATION:
            raise ValueError(f"unknown action kind {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _PATTERN.match(text.strip())
        if not m:
            raise ValueError(
                f"cannot parse action {text!r}: expected stage, kind, microbatch as in '2F0'"
            )
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


Schedule = list[list[Action]]


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: 'rank 0: 0F0 0F1 0B0 ...'."""
    return "\n".join(
        f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(schedule)
    )


def parse_schedule(text: str) -> Schedule:
    """Inverse of format_schedule (the 'rank N:' prefixes are optional)."""
    lines = [ln.split(":", 1)[-1] for ln in text.strip().splitlines() if ln.strip()]
    return [[Action.parse(tok) for tok in ln.split()] for ln in lines]
