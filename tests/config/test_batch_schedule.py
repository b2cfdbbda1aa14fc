"""Batch-size ramp-up and --train-samples: iterations_for agrees with stepping through the
schedule."""

from hypothesis import given
from hypothesis import strategies as st

from fmeg.config.batch_schedule import global_batch_size, iterations_for


def stepped(samples: int, final: int, rampup) -> int:
    """One iteration at a time: ramp-up steps always run; full-size batches only while they fit."""
    consumed = iterations = 0
    while consumed < samples:
        batch = global_batch_size(consumed, final, rampup)
        if batch == final and consumed + batch > samples:
            break
        consumed, iterations = consumed + batch, iterations + 1
    return iterations


@given(
    samples=st.integers(0, 5000),
    unit=st.integers(1, 8),
    start=st.integers(1, 4),
    steps=st.integers(0, 4),
    ramp_samples=st.integers(1, 600),
    ramp=st.booleans(),
)
def test_iterations_for_matches_stepping(samples, unit, start, steps, ramp_samples, ramp):
    final = unit * (start + steps)
    rampup = (unit * start, unit, ramp_samples) if ramp else None
    assert iterations_for(samples, final, rampup) == stepped(samples, final, rampup)


def test_without_ramp_up_the_remainder_is_dropped():
    assert (iterations_for(160, 8), iterations_for(167, 8), iterations_for(7, 8)) == (20, 20, 0)
