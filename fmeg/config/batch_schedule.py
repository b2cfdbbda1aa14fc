"""The global batch size over a run, a pure function of the samples consumed so far.

Megatron's two forms: --rampup-batch-size START INCREMENT SAMPLES (the global batch starts at START
and grows by INCREMENT each SAMPLES / ((final - START) / INCREMENT) consumed samples until it
reaches the final --global-batch-size; current Megatron ignores it), and --step-batch-size-schedule
"0:768 250B:1536" (from each threshold in tokens on, that batch; K, M, B and T suffixes; the last
batch is the final one).
"""

from __future__ import annotations


def check_rampup(
    start: int, increment: int, samples: int, final: int, micro_times_dp: int
) -> list[str]:
    problems = []
    if start <= 0 or increment <= 0 or samples <= 0:
        problems.append(
            "--rampup-batch-size needs three positive numbers: start, increment, samples"
        )
    elif (final - start) % increment:
        problems.append(
            f"--rampup-batch-size: --global-batch-size {final} minus start {start} must be a "
            f"multiple of the increment {increment}"
        )
    elif start % micro_times_dp or increment % micro_times_dp:
        problems.append(
            f"--rampup-batch-size: start {start} and increment {increment} must be multiples of "
            f"--micro-batch-size * data-parallel size = {micro_times_dp}"
        )
    elif start > final:
        problems.append(f"--rampup-batch-size: start {start} exceeds --global-batch-size {final}")
    return problems


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    value = float(text[:-1] if scale > 1 else text)
    if not value == value or value in (float("inf"), float("-inf")):
        raise ValueError(text)
    return int(value * scale)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """((first sample, global batch), ...) from Megatron's "THRESHOLD:BATCH ..." (thresholds in
    tokens, turned into samples by // seq_length; commas may separate entries); ValueError naming
    the problem."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        try:
            if not colon:
                raise ValueError(entry)
            steps.append((_number(threshold) // seq_length, _number(batch)))
        except ValueError:
            raise ValueError(
                f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH_SIZE "
                '(e.g. "0:256 10M:512", thresholds in tokens)'
            ) from None
    steps.sort()
    if not steps:
        raise ValueError(
            '--step-batch-size-schedule: no THRESHOLD:BATCH_SIZE entries (e.g. "0:256 10M:512"); '
            "give some, or leave the flag out"
        )
    if steps[0][0] != 0:
        raise ValueError("--step-batch-size-schedule: the first threshold must be 0")
    if any(b[0] == a[0] for a, b in zip(steps, steps[1:])):
        raise ValueError(
            "--step-batch-size-schedule: two thresholds fall on the same sample; make them distinct"
        )
    if any(batch <= 0 for _, batch in steps):
        raise ValueError("--step-batch-size-schedule: every batch size must be positive")
    return tuple(steps)


def global_batch_size(
    consumed: int,
    final: int,
    rampup: tuple[int, int, int] | None = None,
    steps: tuple[tuple[int, int], ...] | None = None,
) -> int:
    """The global batch for the step that starts after `consumed` samples."""
    if steps is not None:
        return [batch for first, batch in steps if consumed >= first][-1]
    if rampup is None:
        return final
    start, increment, samples = rampup
    steps = (final - start) // increment
    if steps == 0:
        return final
    per_step = samples / steps
    return min(final, start + increment * int(consumed / per_step))


def iterations_for(
    samples: int,
    final: int,
    rampup: tuple[int, int, int] | None = None,
    steps: tuple[tuple[int, int], ...] | None = None,
) -> int:
    """Iterations that --train-samples means, as Megatron counts them: every ramp-up step, then
    whole global batches of `final` (a remainder smaller than one batch is not trained)."""
    consumed = iterations = 0
    while consumed < samples:
        batch = global_batch_size(consumed, final, rampup, steps)
        if batch == final and (steps is None or consumed >= steps[-1][0]):
            return iterations + (samples - consumed) // final
        consumed, iterations = consumed + batch, iterations + 1
    return iterations
