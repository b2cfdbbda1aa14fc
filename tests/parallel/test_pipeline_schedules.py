"""Schedules as data: every generated schedule validates, its simulated bubble equals the closed
form, activation memory follows 1F1B's bound, the order is Megatron's, and broken schedules are
named."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fmeg.parallel.pipeline import (
    Action,
    ScheduleError,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_schedule,
    simulate,
    timeline_text,
    validate,
    with_communication,
    zero_bubble_h1,
)
from fmeg.parallel.pipeline.actions import looped, placement_of, v_shape
from fmeg.parallel.pipeline.schedules import by_name, dualpipe_v, forwards, zero_bubble_v

pps, mbs, chunks = st.integers(1, 8), st.integers(1, 32), st.integers(1, 4)


@given(pps, mbs)
def test_gpipe_and_1f1b_validate_and_have_the_closed_form_bubble(pp, m):
    for make in (gpipe, one_f_one_b):
        schedule = make(pp, m)
        validate(schedule, m)
        timeline = simulate(schedule, {"F": 1.0, "B": 2.0})
        assert timeline.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@given(pps, mbs)
def test_1f1b_holds_at_most_pp_minus_rank_microbatches_and_gpipe_holds_all(pp, m):
    peak_1f1b = simulate(one_f_one_b(pp, m)).peak_activations
    assert peak_1f1b == [min(pp - r, m) for r in range(pp)]
    assert simulate(gpipe(pp, m)).peak_activations == [m] * pp


@given(st.integers(2, 8), chunks, st.data())
def test_interleaved_validates_and_shrinks_the_bubble_by_the_interleaving_factor(pp, v, data):
    m = data.draw(st.integers(pp, 32), label="microbatches")
    group = data.draw(st.integers(pp, m), label="group size")
    schedule = interleaved_1f1b(pp, m, v, group)
    validate(schedule, m, stages=pp * v)
    # A chunk costs 1/v of a rank's whole model: the ideal time per rank is m * (F + B) as for 1F1B.
    timeline = simulate(schedule, {"F": 1.0 / v, "B": 2.0 / v})
    # With whole microbatch groups the bubble is (p - 1) / v of a pass, v times smaller than 1F1B's:
    # fraction (p - 1) / (v m + p - 1). A partial last group (m % G != 0) adds bubble, in Megatron
    # too.
    if m % group == 0:
        assert timeline.total == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)
        assert timeline.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_interleaved_refuses_a_bad_group_size():
    with pytest.raises(ValueError, match="microbatch group size"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match="microbatch group size"):
        interleaved_1f1b(4, 8, 2, group_size=2)


@given(st.integers(1, 8), st.integers(1, 32))
def test_zero_bubble_validates_and_keeps_1f1b_memory(pp, m):
    schedule = zero_bubble_h1(pp, m)
    validate(schedule, m)
    assert simulate(schedule).peak_activations == [min(pp - r, m) for r in range(pp)]


def test_zero_bubble_bubble_is_below_1f1b_at_pp4_m8():
    zb = simulate(zero_bubble_h1(4, 8), {"F": 1.0, "B": 1.0, "W": 1.0}).bubble_fraction
    ofob = simulate(one_f_one_b(4, 8), {"F": 1.0, "B": 2.0}).bubble_fraction
    assert zb < ofob, (zb, ofob)


@given(st.integers(1, 8), st.integers(1, 32))
def test_zero_bubble_v_validates_in_a_v_and_keeps_1f1b_memory(pp, m):
    schedule = zero_bubble_v(pp, m)
    assert placement_of(schedule) == v_shape(pp)
    validate(schedule, m, placement=v_shape(pp))
    # chunk activations: 1F1B's peak of pp microbatches of a whole rank's layers is 2 pp chunks'
    assert max(simulate(schedule).peak_activations) <= 2 * pp


@given(st.integers(1, 8), st.data())
def test_dualpipe_v_validates_in_a_v(pp, data):
    m = data.draw(st.integers(2 * pp, 40), label="microbatches")
    schedule = dualpipe_v(pp, m)
    validate(schedule, m, placement=v_shape(pp))
    # DualPipeV's own bound: one microbatch more than 1F1B's, in chunks
    assert max(simulate(schedule).peak_activations) <= 2 * pp + 1


def test_dualpipe_v_refuses_fewer_than_two_microbatches_per_stage():
    with pytest.raises(ValueError, match=r"DualPipeV needs at least 2 x pipeline size \(8\)"):
        dualpipe_v(4, 7)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_the_v_schedules_have_less_bubble_than_zb_h1_and_1f1b(pp, m):
    # one chunk is half a rank's layers: its F, B and W take half of ZB-H1's
    half = {"F": 0.5, "B": 0.5, "W": 0.5}
    zbv = simulate(zero_bubble_v(pp, m), half).bubble_fraction
    dpv = simulate(dualpipe_v(pp, m), half).bubble_fraction
    zbh1 = simulate(zero_bubble_h1(pp, m), {"F": 1.0, "B": 1.0, "W": 1.0}).bubble_fraction
    ofob = simulate(one_f_one_b(pp, m), {"F": 1.0, "B": 2.0}).bubble_fraction
    assert max(zbv, dpv) < zbh1 < ofob, (zbv, dpv, zbh1, ofob)


def test_zero_bubble_v_at_pp4_m8_is_as_short_as_the_hand_made_order():
    # the hand-made ZB-V order (torch.distributed.pipelining's ScheduleZBVZeroBubble, simulated
    # here with F = B = W) takes 25.5 units: each rank's 2m chunks of F, B and W (24) and 1.5 of
    # bubble; the list scheduler's is as short and holds as much
    timeline = simulate(zero_bubble_v(4, 8), {"F": 0.5, "B": 0.5, "W": 0.5})
    assert timeline.total == pytest.approx(25.5)
    assert timeline.peak_activations == [8, 8, 8, 8]


def test_the_v_turns_on_one_rank_without_a_message():
    full = with_communication(zero_bubble_v(3, 4))
    # stages 2 and 3 are both on rank 2; the loss's stage 5 is on rank 0
    assert Action(2, "SEND_F", 0) not in full[2] and Action(3, "RECV_F", 0) not in full[2]
    assert Action(3, "SEND_B", 0) not in full[2]
    assert Action(5, "F", 0) in full[0] and Action(4, "SEND_B", 0) in full[1]


def test_a_stage_on_two_ranks_is_named():
    s = zero_bubble_v(2, 2)
    s[1].append(Action(0, "F", 2))
    with pytest.raises(ValueError, match="stage 0 has actions on ranks 0 and 1"):
        placement_of(s)
    s = zero_bubble_v(2, 2)
    with pytest.raises(ScheduleError, match=r"stage 3 belongs on rank 1"):
        # the V read as Megatron's loop
        validate(s, 2)


@pytest.mark.parametrize("pp, chunks", [(1, 1), (4, 1), (2, 3), (4, 2)])
def test_forward_only_order_is_gpipes_and_interleaved_with_one_group(pp, chunks):
    m = 5 if chunks == 1 else 8
    want = gpipe(pp, m) if chunks == 1 else interleaved_1f1b(pp, m, chunks, group_size=m)
    assert forwards(looped(pp, chunks), m) == [
        [a for a in actions if a.kind == "F"] for actions in want
    ]


def test_by_name_gives_each_schedule():
    assert by_name("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert by_name("1f1b", 4, 8, chunks=2) == interleaved_1f1b(4, 8, 2)
    assert by_name("zero_bubble_v", 4, 8, chunks=2) == zero_bubble_v(4, 8)
    with pytest.raises(ValueError, match="dualpipe_v places exactly 2 chunks per rank, got 3"):
        by_name("dualpipe_v", 4, 8, chunks=3)


def test_1f1b_matches_megatrons_documented_order():
    # Megatron: rank r runs min(pp - r - 1, M) warm-up forwards, then 1F1B, then the cooldown.
    assert format_schedule(one_f_one_b(4, 6)).splitlines() == [
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
        "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
        "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ]


def test_interleaved_matches_megatrons_documented_table():
    # Megatron's docstring example, PP2 M5 VP2 with group size 3: virtual microbatches 0..9 run
    # microbatches 0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1.
    forwards = [a for a in interleaved_1f1b(2, 5, 2, group_size=3)[0] if a.kind == "F"]
    assert [a.microbatch for a in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [a.stage // 2 for a in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize(
    "pp, m, v, group",
    [
        (2, 4, 2, 2),
        (4, 8, 2, 4),
        (4, 12, 3, 4),
        (2, 5, 2, 3),
        (3, 7, 2, 4),
        (4, 4, 4, 4),
        (8, 16, 2, 8),
    ],
)
def test_interleaved_order_equals_megatron_core(pp, m, v, group):
    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    table = sched.get_schedule_table(m, v, group)
    ours = interleaved_1f1b(pp, m, v, group)
    for r in range(pp):
        comm = type(
            "P2P", (), {"pp_group": _FakeGroup(pp, r), "virtual_pipeline_model_parallel_size": v}
        )()
        total, _, warmup, remaining = sched.get_pp_rank_microbatches(
            m, v, group, p2p_communicator=comm
        )
        fwd = lambda k: Action(table[k][1] * pp + r, "F", table[k][0])  # noqa: E731
        bwd = lambda k: Action((v - 1 - table[k][1]) * pp + r, "B", table[k][0])  # noqa: E731
        want = [fwd(k) for k in range(warmup)]
        for k in range(remaining):
            want += [fwd(k + warmup), bwd(k)]
        want += [bwd(k) for k in range(remaining, total)]
        assert ours[r] == want, r


def test_format_and_parse_round_trip():
    s = with_communication(interleaved_1f1b(2, 4, 2))
    assert parse_schedule(format_schedule(s)) == s
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F0")


def test_a_missing_backward_is_named():
    s = one_f_one_b(2, 3)
    s[1].remove(Action(1, "B", 2))
    with pytest.raises(ScheduleError, match=r"rank 1: 1B2 is missing"):
        validate(s, 3)


def test_a_swapped_send_and_receive_is_named():
    s = with_communication(one_f_one_b(2, 2))
    r0 = s[0]  # receive the gradient of microbatch 0 before sending its activation: a cycle
    r0.remove(Action(0, "RECV_B", 0))
    r0.insert(r0.index(Action(0, "SEND_F", 0)), Action(0, "RECV_B", 0))
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0, step \d+ \(0RECV_B0\) waits for 1SEND_B0"
    ):
        validate(s, 2)


def test_mismatched_channel_order_is_named():
    s = with_communication(gpipe(2, 2))
    a, b = s[1].index(Action(1, "RECV_F", 0)), s[1].index(Action(1, "RECV_F", 1))
    s[1][a], s[1][b] = s[1][b], s[1][a]
    with pytest.raises(
        ScheduleError, match=r"rank 1, step \d+ \(1RECV_F1\): message 0 from rank 0 is 0SEND_F0"
    ):
        validate(s, 2)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s[0].insert(0, Action(0, "B", 0)), r"rank 0, step 0 \(0B0\): runs before 0F0"),
        (lambda s: s[0].append(Action(1, "F", 0)), r"stage 1 belongs on rank 1"),
        (lambda s: s[0].append(Action(0, "F", 0)), r"already ran"),
    ],
)
def test_misplaced_and_duplicated_actions_are_named(edit, match):
    s = one_f_one_b(2, 2)
    edit(s)
    with pytest.raises(ScheduleError, match=match):
        validate(s, 2)


def test_text_chart_shows_every_rank():
    text = timeline_text(simulate(one_f_one_b(4, 8), {"F": 1, "B": 2}), width=60)
    assert (
        sum(line.startswith("rank") for line in text.splitlines()) == 4 and "bubble 0.273" in text
    )


def test_png_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from fmeg.parallel.pipeline import draw_timeline

    path = draw_timeline(simulate(zero_bubble_h1(4, 8)), tmp_path / "zb.png", "ZB-H1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp.png"))


def test_segments_that_miss_or_repeat_a_parameter_are_named():
    import torch

    from fmeg.parallel.pipeline.segments import Segment, check_cover

    params = {"a": torch.zeros(1), "b": {"c": torch.zeros(1)}}
    fn = lambda sub, x, batch: x  # noqa: E731
    check_cover([Segment(fn, ("a",)), Segment(fn, ("b",))], params, 0)
    with pytest.raises(ValueError, match=r"missing \['b.c'\]"):
        check_cover([Segment(fn, ("a",))], params, 0)
    with pytest.raises(ValueError, match=r"twice \['a'\]"):
        check_cover([Segment(fn, ("a",)), Segment(fn, ("a",)), Segment(fn, ("b",))], params, 0)
