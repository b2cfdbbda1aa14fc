"""Global batch size ramp-up (Megatron's --rampup-batch-size START INCREMENT SAMPLES), a pure function.

The global batch starts at START and grows by INCREMENT each SAMPLES / ((final - START) / INCREMENT)
consumed samples until it reaches the final --global-batch-size.
"""

from __future__ import annotations


def check_rampup(start: int, increment: int, samples: int, final: int, micro_times_dp: int) -> list[str]:
    problems = []
    if start <= 0 or increment <= 0 or samples <= 0:
        problems.append("--rampup-batch-size needs three positive numbers: start, increment, samples")
    elif (final - start) % increment:
        problems.append(f"--rampup-batch-size: --global-batch-size {final} minus start {start} must be a multiple "
                        f"of the increment {increment}")
    elif start % micro_times_dp or increment % micro_times_dp:
        problems.append(f"--rampup-batch-size: start {start} and increment {increment} must be multiples of "
                        f"--micro-batch-size * data-parallel size = {micro_times_dp}")
    elif start > final:
        problems.append(f"--rampup-batch-size: start {start} exceeds --global-batch-size {final}")
    return problems


def global_batch_size(consumed: int, final: int, rampup: tuple[int, int, int] | None = None) -> int:
    """The global batch for the step that starts after `consumed` samples."""
    if rampup is None:
        return final
    start, increment, samples = rampup
    steps = (final - start) // increment
    if steps == 0:
        return final
    per_step = samples / steps
    return min(final, start + increment * int(consumed / per_step))


def iterations_for(samples: int, final: int, rampup: tuple[int, int, int] | None = None) -> int:
    """Iterations that --train-samples means, as Megatron counts them: every ramp-up step, then whole
    global batches of `final` (a remainder smaller than one batch is not trained)."""
    consumed = iterations = 0
    while consumed < samples:
        batch = global_batch_size(consumed, final, rampup)
        if batch == final:
            return iterations + (samples - consumed) // final
        consumed, iterations = consumed + batch, iterations + 1
    return iterations
