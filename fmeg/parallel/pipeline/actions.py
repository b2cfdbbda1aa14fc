"""Actions: what one pipeline rank does next, written as PyTorch's pipelining writes them ("2F0").

A schedule is a list per pipeline rank of Actions in execution order. Stages are virtual: with v
model chunks per rank and pp ranks the model's layers run through stages 0, 1, ..., v * pp - 1 in
order. A placement says which rank holds each stage: `looped` (Megatron's interleaving: stage s on
rank s % pp) or `v_shape` (two chunks per rank, down the ranks and back up: stages s and
2 pp - 1 - s on rank s, so the loss is computed on rank 0 and the turn needs no message).

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
# the rank of each stage, indexed by stage
Placement = tuple[int, ...]


def looped(pp: int, chunks: int = 1) -> Placement:
    """Megatron's placement: stage s on rank s % pp."""
    return tuple(s % pp for s in range(pp * chunks))


def v_shape(pp: int) -> Placement:
    """ZB-V's and DualPipeV's placement: rank r holds stages r and 2 pp - 1 - r."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


def placement_of(schedule: Schedule) -> Placement:
    """The placement a schedule's own actions describe (a stage on two ranks is an error)."""
    ranks: dict[int, int] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if ranks.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} has actions on ranks {ranks[a.stage]} and {r}")
    if sorted(ranks) != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise ValueError(f"stages {missing} have no actions in the schedule")
    return tuple(ranks[s] for s in range(len(ranks)))


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: 'rank 0: 0F0 0F1 0B0 ...'."""
    return "\n".join(
        f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(schedule)
    )


def parse_schedule(text: str) -> Schedule:
    """Inverse of format_schedule (the 'rank N:' prefixes are optional)."""
    lines = [ln.split(":", 1)[-1] for ln in text.strip().splitlines() if ln.strip()]
    return [[Action.parse(tok) for tok in ln.split()] for ln in lines]
