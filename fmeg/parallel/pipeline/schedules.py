"""Schedule generators: pure functions (pp, microbatches[, chunks]) -> per-rank compute actions.

gpipe and one_f_one_b place one stage per rank; interleaved_1f1b places v chunks per rank
(Megatron's virtual pipeline); zero_bubble_h1 splits the backward into B (input gradient) and W
(weight gradient) and uses W to fill the bubble. with_communication adds the sends and receives any
of them needs.
"""

from __future__ import annotations

from fmeg.parallel.pipeline.actions import Action, Schedule


def _check(pp: int, microbatches: int) -> None:
    if pp < 1 or microbatches < 1:
        raise ValueError(
            f"pipeline size ({pp}) and number of microbatches ({microbatches}) must be positive"
        )


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in microbatch order)."""
    _check(pp, microbatches)
    return [
        [Action(r, "F", m) for m in range(microbatches)]
        + [Action(r, "B", m) for m in range(microbatches)]
        for r in range(pp)
    ]


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """Megatron's non-interleaved 1F1B: min(pp - rank - 1, M) warm-up forwards, then one forward and
    one backward in turn, then the remaining backwards."""
    _check(pp, microbatches)
    schedule = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        actions = [Action(r, "F", m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action(r, "F", warmup + i), Action(r, "B", i)]
        actions += [Action(r, "B", m) for m in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule


def interleaved_table(microbatches: int, chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each virtual step: groups of group_size microbatches go through chunk
    0, then chunk 1, ...; the last group takes what is left (Megatron's schedule table)."""
    table = []
    for first in range(0, microbatches, group_size):
        last = microbatches if first + group_size >= microbatches else first + group_size
        table += [(m, c) for c in range(chunks) for m in range(first, last)]
    return table


def interleaved_1f1b(
    pp: int, microbatches: int, chunks: int, group_size: int | None = None
) -> Schedule:
    """Megatron's interleaved 1F1B over v = chunks model chunks per rank.

    Rank r runs (pp - r - 1) * 2 + (v - 1) * G warm-up forwards (at most M * v), then alternates a
    forward and a backward; forward step k runs table[k], backward step k the same microbatch on
    chunk v - 1 - chunk. G (microbatch group size) defaults to pp and must satisfy pp <= G <= M.
    """
    _check(pp, microbatches)
    if chunks < 1:
        raise ValueError(f"number of model chunks must be positive, got {chunks}")
    if chunks == 1:
        return one_f_one_b(pp, microbatches)
    group = pp if group_size is None else group_size
    if not pp <= group <= microbatches:
        raise ValueError(
            f"interleaved schedule needs pipeline size ({pp}) <= microbatch group size ({group}) "
            f"<= number of microbatches ({microbatches})"
        )
    table = interleaved_table(microbatches, chunks, group)
    total = microbatches * chunks
    schedule = []
    for r in range(pp):
        fwd = lambda k: Action(table[k][1] * pp + r, "F", table[k][0])  # noqa: E731
        bwd = lambda k: Action((chunks - 1 - table[k][1]) * pp + r, "B", table[k][0])  # noqa: E731
        warmup = min((pp - r - 1) * 2 + (chunks - 1) * group, total)
        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(warmup + k), bwd(k)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zero_bubble_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): the 1F1B order of F and B, with each weight gradient W placed by a
    unit-time list scheduler: a rank runs a ready B first, then an F while it holds fewer than pp -
    rank microbatches (1F1B's peak activation memory; a microbatch is held until its W), else a
    pending W. The W that would otherwise wait for the cooldown fills the bubble."""
    _check(pp, microbatches)
    # (kind, rank, microbatch) -> finish time
    done: dict[tuple[str, int, int], int] = {}
    next_f, next_b, pending_w = [0] * pp, [0] * pp, [[] for _ in range(pp)]
    schedule: Schedule = [[] for _ in range(pp)]
    t = 0
    while any(len(a) < 3 * microbatches for a in schedule):
        for r in range(pp):
            b, f = next_b[r], next_f[r]
            b_ready = b < f and (
                done.get(("B", r + 1, b), t + 1) <= t
                if r < pp - 1
                else done.get(("F", r, b), t + 1) <= t
            )
            # forwards done minus weight gradients done
            held = f - (len(schedule[r]) - f - b)
            f_ready = (
                f < microbatches
                and held < pp - r
                and (r == 0 or done.get(("F", r - 1, f), t + 1) <= t)
            )
            if b_ready:
                action, next_b[r] = Action(r, "B", b), b + 1
                pending_w[r].append(b)
            elif f_ready:
                action, next_f[r] = Action(r, "F", f), f + 1
            elif pending_w[r]:
                action = Action(r, "W", pending_w[r].pop(0))
            else:
                continue
            schedule[r].append(action)
            done[(action.kind, r, action.microbatch)] = t + 1
        t += 1
    return schedule


def num_stages(schedule: Schedule) -> int:
    return 1 + max(a.stage for actions in schedule for a in actions)


def with_communication(schedule: Schedule) -> Schedule:
    """Insert RECV before and SEND after each compute action whose neighbour stage is on another
    rank.

    F of stage s > 0 receives its input from stage s - 1; F of a non-last stage sends its output to
    s + 1; B of a non-last stage receives the output gradient from s + 1; B of stage s > 0 sends the
    input gradient to s - 1. W needs nothing. Existing communication actions are kept as they are.
    """
    pp, stages = len(schedule), num_stages(schedule)
    out: Schedule = []
    for actions in schedule:
        new = []
        for a in actions:
            if not a.is_compute or a.kind == "W":
                new.append(a)
                continue
            prev_remote = a.stage > 0 and (a.stage - 1) % pp != a.stage % pp
            next_remote = a.stage < stages - 1 and (a.stage + 1) % pp != a.stage % pp
            if a.kind == "F":
                new += (
                    ([Action(a.stage, "RECV_F", a.microbatch)] if prev_remote else [])
                    + [a]
                    + ([Action(a.stage, "SEND_F", a.microbatch)] if next_remote else [])
                )
            else:
                new += (
                    ([Action(a.stage, "RECV_B", a.microbatch)] if next_remote else [])
                    + [a]
                    + ([Action(a.stage, "SEND_B", a.microbatch)] if prev_remote else [])
                )
        out.append(new)
    return out
