"""Schedule generators: pure functions (pp, microbatches[, chunks]) -> per-rank compute actions.

gpipe and one_f_one_b place one stage per rank; interleaved_1f1b places v chunks per rank
(Megatron's virtual pipeline); zero_bubble_h1 splits the backward into B (input gradient) and W
(weight gradient) and uses W to fill the bubble. with_communication adds the sends and receives any
of them needs.
"""

from __future__ import annotations

from fmeg.parallel.pipeline.actions import Action, Placement, Schedule, placement_of


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


def zero_bubble_v(pp: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V (actions.v_shape), the backward
    split into B and W, placed by a unit-time list scheduler: a rank runs a ready B first (the
    later stage's when both are ready), then a ready F (the later stage's first) if its memory
    allows, else its oldest pending W. A rank holds at most 2 pp chunk activations (1F1B's peak:
    pp microbatches of a whole rank's layers), freed at W. A microbatch's first-chunk F reserves
    room for its second-chunk activation too (which cannot deadlock); reserving one unit less
    often finds a shorter order within the same peak, so both are simulated (F = B = W) and the
    shorter one within 2 pp activations is taken."""
    from fmeg.parallel.pipeline.simulate import simulate

    _check(pp, microbatches)
    safe = _zero_bubble_v_list(pp, microbatches, reserve=2)
    bolder = _zero_bubble_v_list(pp, microbatches, reserve=1)
    if bolder is None:
        return safe
    timelines = [simulate(s) for s in (safe, bolder)]
    fits = max(timelines[1].peak_activations) <= 2 * pp
    return bolder if fits and timelines[1].total < timelines[0].total else safe


def _zero_bubble_v_list(pp: int, microbatches: int, reserve: int) -> Schedule | None:
    """The list scheduler of zero_bubble_v, a first-chunk F admitted while the rank's held and
    owed activations plus `reserve` fit in 2 pp; None if it stalls (reserve 1 can)."""
    stages = 2 * pp
    # (kind, stage, microbatch) -> the time slot after which it is done
    done: dict[tuple[str, int, int], int] = {}
    # per stage: the next F, B and W to run
    count = {kind: [0] * stages for kind in "FBW"}
    pending: list[list[Action]] = [[] for _ in range(pp)]
    schedule: Schedule = [[] for _ in range(pp)]

    def finished(key: tuple[str, int, int], t: int) -> bool:
        return done.get(key, t + 1) <= t

    def next_action(r: int, t: int) -> Action | None:
        first, second = r, stages - 1 - r
        for s in (second, first):
            b = count["B"][s]
            grad_in = ("B", s + 1, b) if s < stages - 1 else ("F", s, b)
            if b < count["F"][s] and finished(grad_in, t):
                pending[r].append(Action(s, "W", b))
                return Action(s, "B", b)
        # held, and owed: the second-chunk activations of the microbatches past the first chunk
        committed = 2 * count["F"][first] - count["W"][first] - count["W"][second]
        for s in (second, first):
            f = count["F"][s]
            x_in = s == 0 or finished(("F", s - 1, f), t)
            if f < microbatches and x_in and (s == second or committed + reserve <= stages):
                return Action(s, "F", f)
        return pending[r].pop(0) if pending[r] else None

    t = 0
    while any(len(a) < 6 * microbatches for a in schedule):
        idle = True
        for r in range(pp):
            action = next_action(r, t)
            if action is not None:
                idle = False
                count[action.kind][action.stage] += 1
                schedule[r].append(action)
                done[(action.kind, action.stage, action.microbatch)] = t + 1
        # nothing ran and nothing is under way: stalled
        if idle and all(end <= t for end in done.values()):
            return None
        t += 1
    return schedule


def dualpipe_v(pp: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half, as in deepseek-ai/DualPipe): two chunks per rank
    in a V, at least 2 pp microbatches. Rank r runs 2 (pp - r - 1) first-chunk forwards, r + 1
    pairs of forwards (first chunk, then second), pp - r - 1 rounds of (second chunk's B, a pending
    W, its F), then the main phase's pairs of a forward of one chunk with a full backward of the
    other (which DualPipe runs overlapped, hiding one's communication behind the other's compute;
    here one after the other), and the cool-down, whose later backwards split off their W to fill
    the bubble. A full backward is a B followed at once by its W."""
    _check(pp, microbatches)
    if microbatches < 2 * pp:
        raise ValueError(
            f"DualPipeV needs at least 2 x pipeline size ({2 * pp}) microbatches, "
            f"got {microbatches}"
        )
    return [_dualpipe_v_rank(pp, microbatches, r) for r in range(pp)]


def _dualpipe_v_rank(pp: int, microbatches: int, r: int) -> list[Action]:
    stages = (r, 2 * pp - 1 - r)
    counts = {(kind, c): 0 for kind in "FB" for c in (0, 1)}
    pending: list[Action] = []
    out: list[Action] = []

    def forward(c: int) -> None:
        out.append(Action(stages[c], "F", counts[("F", c)]))
        counts[("F", c)] += 1

    def backward(c: int, split: bool) -> None:
        b = Action(stages[c], "B", counts[("B", c)])
        counts[("B", c)] += 1
        out.append(b)
        w = Action(b.stage, "W", b.microbatch)
        pending.append(w) if split else out.append(w)

    def weight() -> None:
        if pending:
            out.append(pending.pop(0))

    for _ in range(2 * (pp - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(pp - r - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(microbatches - 2 * pp + r + 1):
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(pp - r - 1):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    # the second half of the last r + 1 rounds splits W off (the odd ranks one backward earlier)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(0, split)
    for _ in range(pp - r - 1):
        weight()
        backward(0, split)
    while pending:
        weight()
    return out


SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "zero_bubble_v", "dualpipe_v")
# the schedules that place two chunks per rank in a V
V_SCHEDULES = ("zero_bubble_v", "dualpipe_v")


def by_name(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule a run's --pipeline-schedule names: with chunks > 1, interleaved 1F1B unless
    the name is a V schedule (which takes exactly two chunks per rank)."""
    if name in V_SCHEDULES:
        if chunks != 2:
            raise ValueError(f"{name} places exactly 2 chunks per rank, got {chunks}")
        return (zero_bubble_v if name == "zero_bubble_v" else dualpipe_v)(pp, microbatches)
    if chunks > 1:
        return interleaved_1f1b(pp, microbatches, chunks)
    return {"1f1b": one_f_one_b, "gpipe": gpipe, "zero_bubble": zero_bubble_h1}[name](
        pp, microbatches
    )


def forwards(placement: Placement, microbatches: int) -> Schedule:
    """Forward only (evaluation): each rank runs its stages in order, every microbatch through one
    before the next (GPipe's forwards; interleaved 1F1B's with one group of all microbatches)."""
    ranks = 1 + max(placement)
    return [
        [
            Action(s, "F", m)
            for s in range(len(placement))
            if placement[s] == r
            for m in range(microbatches)
        ]
        for r in range(ranks)
    ]


def num_stages(schedule: Schedule) -> int:
    return 1 + max(a.stage for actions in schedule for a in actions)


def with_communication(schedule: Schedule) -> Schedule:
    """Insert RECV before and SEND after each compute action whose neighbour stage is on another
    rank (the placement is the schedule's own: placement_of).

    F of stage s > 0 receives its input from stage s - 1; F of a non-last stage sends its output to
    s + 1; B of a non-last stage receives the output gradient from s + 1; B of stage s > 0 sends the
    input gradient to s - 1. W needs nothing. Existing communication actions are kept as they are.
    """
    stages, rank = num_stages(schedule), placement_of(schedule)
    out: Schedule = []
    for actions in schedule:
        new = []
        for a in actions:
            if not a.is_compute or a.kind == "W":
                new.append(a)
                continue
            prev_remote = a.stage > 0 and rank[a.stage - 1] != rank[a.stage]
            next_remote = a.stage < stages - 1 and rank[a.stage + 1] != rank[a.stage]
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
