"""Simulate a schedule: when each action runs on each rank, the bubble, and the activations held.

The communication model is the executor's: a send is buffered (the sender goes on at once) and a
receive blocks until the matching send has happened (plus `latency`). Compute actions cost
costs[kind] (or a function of the action). A schedule that cannot finish under this model raises
ScheduleError naming what every stuck rank waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fmeg.parallel.pipeline.actions import Action, Schedule
from fmeg.parallel.pipeline.schedules import num_stages, with_communication


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order, mismatched or deadlocked."""


@dataclass
class Timeline:
    # per rank: (action, start, end), compute and communication
    events: list[list[tuple[Action, float, float]]]
    total: float
    # per rank: most (stage, microbatch) pairs held between F and release
    peak_activations: list[int]

    @property
    def busy(self) -> list[float]:
        return [sum(e - s for a, s, e in events if a.is_compute) for events in self.events]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: 1 - busy / (ranks * total)."""
        return 1.0 - sum(self.busy) / (len(self.events) * self.total) if self.total else 0.0


def _peer(action: Action, stages: int) -> tuple[str, int, int]:
    """The message a receive waits for: (send kind, sending stage, microbatch)."""
    if action.kind == "RECV_F":
        return ("SEND_F", action.stage - 1, action.microbatch)
    return ("SEND_B", action.stage + 1, action.microbatch)


def _local_dependency(
    action: Action, stages: int, split_backward: bool
) -> tuple[str, int, int] | None:
    """The compute action that must finish before this one (across stages or on the same stage)."""
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return ("F", s - 1, m) if s > 0 else None
    if action.kind == "B":
        return ("B", s + 1, m) if s < stages - 1 else ("F", s, m)
    # W after its B
    return ("B", s, m)


def simulate(
    schedule: Schedule,
    costs: dict[str, float] | Callable[[Action], float] | None = None,
    latency: float = 0.0,
) -> Timeline:
    cost = (
        costs
        if callable(costs)
        else (lambda a, c={"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}: c[a.kind])
    )
    if not any(not a.is_compute for actions in schedule for a in actions):
        schedule = with_communication(schedule)
    pp, stages = len(schedule), num_stages(schedule)
    split_backward = any(a.kind == "W" for actions in schedule for a in actions)
    # (kind, stage, microbatch) -> time it completed
    finished: dict[tuple[str, int, int], float] = {}
    clock, step = [0.0] * pp, [0] * pp
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    held, peak = [set() for _ in range(pp)], [0] * pp
    while True:
        progressed = False
        for r in range(pp):
            while step[r] < len(schedule[r]):
                a = schedule[r][step[r]]
                if a.kind.startswith("RECV"):
                    ready = finished.get(_peer(a, stages))
                    if ready is None:
                        break
                    start = max(clock[r], ready + latency)
                    end = start
                elif a.kind.startswith("SEND"):
                    start = end = clock[r]
                else:
                    dep = _local_dependency(a, stages, split_backward)
                    ready = 0.0 if dep is None else finished.get(dep)
                    if ready is None:
                        break
                    start = max(clock[r], ready)
                    end = start + cost(a)
                    key = (a.stage, a.microbatch)
                    if a.kind == "F":
                        held[r].add(key)
                        peak[r] = max(peak[r], len(held[r]))
                    elif a.kind == "W" or not split_backward:
                        held[r].discard(key)
                finished[(a.kind, a.stage, a.microbatch)] = end
                events[r].append((a, start, end))
                clock[r] = end
                step[r] += 1
                progressed = True
        if all(step[r] == len(schedule[r]) for r in range(pp)):
            return Timeline(events, max(clock), peak)
        if not progressed:
            stuck = [
                f"rank {r}, step {step[r]} ({schedule[r][step[r]]}) waits for "
                f"{_waits_for(schedule[r][step[r]], stages)}"
                for r in range(pp)
                if step[r] < len(schedule[r])
            ]
            raise ScheduleError("deadlock: " + "; ".join(stuck))


def _waits_for(a: Action, stages: int) -> str:
    if a.kind.startswith("RECV"):
        kind, s, m = _peer(a, stages)
        return f"{s}{kind}{m}"
    dep = _local_dependency(a, stages, True)
    return f"{dep[1]}{dep[0]}{dep[2]}" if dep else "nothing"


def timeline_text(timeline: Timeline, width: int = 100) -> str:
    """A terminal chart: one row per rank, one character per time slot (F, B, W; '.' idle)."""
    scale = width / timeline.total if timeline.total else 1.0
    rows = []
    for r, events in enumerate(timeline.events):
        line = ["."] * width
        for a, s, e in events:
            if a.is_compute:
                for i in range(int(s * scale), max(int(s * scale) + 1, int(e * scale))):
                    line[min(i, width - 1)] = a.kind
        rows.append(f"rank {r} |{''.join(line)}|")
    rows.append(
        f"bubble {timeline.bubble_fraction:.3f}, peak activations per rank "
        f"{timeline.peak_activations}"
    )
    return "\n".join(rows)
