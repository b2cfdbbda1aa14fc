"""One checker for any schedule: placement, completeness, order, matching sends and receives, no
deadlock.

Every problem is reported with the rank, the step (index in that rank's list) and the action.
"""

from __future__ import annotations

from collections import defaultdict

from fmeg.parallel.pipeline.actions import Action, Placement, Schedule
from fmeg.parallel.pipeline.schedules import num_stages, with_communication
from fmeg.parallel.pipeline.simulate import ScheduleError, simulate


def validate(
    schedule: Schedule,
    microbatches: int,
    stages: int | None = None,
    placement: Placement | None = None,
) -> None:
    """Raise ScheduleError unless every (stage, microbatch) has one F and one B (and one W, if the
    schedule uses W at all), each on the stage's rank (placement; Megatron's looped one, stage %
    pp, by default), in order F < B < W on that rank, with sends and receives matching in order on
    every channel and the whole schedule finishing without deadlock."""
    pp = len(schedule)
    stages = stages or num_stages(schedule)
    rank_of = placement or tuple(s % pp for s in range(stages))
    uses_w = any(a.kind == "W" for actions in schedule for a in actions)
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            where = f"rank {r}, step {i} ({a})"
            if a.stage >= stages:
                raise ScheduleError(f"{where}: there are only {stages} stages")
            if rank_of[a.stage] != r:
                raise ScheduleError(f"{where}: stage {a.stage} belongs on rank {rank_of[a.stage]}")
            if not 0 <= a.microbatch < microbatches:
                raise ScheduleError(
                    f"{where}: microbatch {a.microbatch} is outside 0..{microbatches - 1}"
                )
            if not a.is_compute:
                continue
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"{where}: {a} already ran at step {seen[key][1]}")
            seen[key] = (r, i)
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.stage, a.microbatch) not in seen:
                raise ScheduleError(f"{where}: runs before {a.stage}{before}{a.microbatch}")
    kinds = ("F", "B", "W") if uses_w else ("F", "B")
    for s in range(stages):
        for m in range(microbatches):
            for kind in kinds:
                if (kind, s, m) not in seen:
                    raise ScheduleError(f"rank {rank_of[s]}: {s}{kind}{m} is missing")
    full = (
        schedule
        if any(not a.is_compute for acts in schedule for a in acts)
        else with_communication(schedule)
    )
    _check_channels(full, rank_of)
    simulate(full)


def _check_channels(schedule: Schedule, rank_of: Placement) -> None:
    """The i-th send from rank a to rank b must be what the i-th receive on b from a expects.

    Activations and gradients are separate channels (the executor tags them), so a forward message
    may overtake a backward one between the same two ranks, as interleaved schedules need."""
    sends: dict[tuple[int, int, str], list[tuple[int, int, Action]]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[tuple[int, int, Action]]] = defaultdict(list)
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            peer = a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)
            if not a.is_compute and not 0 <= peer < len(rank_of):
                raise ScheduleError(f"rank {r}, step {i} ({a}): there is no stage {peer}")
            if a.kind.startswith("SEND"):
                sends[(r, rank_of[peer], a.kind[-1])].append((r, i, a))
            elif a.kind.startswith("RECV"):
                recvs[(rank_of[peer], r, a.kind[-1])].append((r, i, a))
    for channel in set(sends) | set(recvs):
        out, inc = sends[channel], recvs[channel]
        for n, (s, v) in enumerate(zip(out, inc)):
            expected = Action(
                s[2].stage + (1 if s[2].kind == "SEND_F" else -1),
                "RECV_F" if s[2].kind == "SEND_F" else "RECV_B",
                s[2].microbatch,
            )
            if v[2] != expected:
                raise ScheduleError(
                    f"rank {v[0]}, step {v[1]} ({v[2]}): message {n} from rank {channel[0]} is "
                    f"{s[2]} (rank {s[0]}, step {s[1]}), which {expected} would receive"
                )
        if len(out) != len(inc):
            extra = (out if len(out) > len(inc) else inc)[min(len(out), len(inc))]
            raise ScheduleError(
                f"rank {extra[0]}, step {extra[1]} ({extra[2]}): no matching "
                f"{'receive' if len(out) > len(inc) else 'send'} on rank "
                f"{channel[1] if len(out) > len(inc) else channel[0]}"
            )
