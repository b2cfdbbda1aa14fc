"""Where the runner's metrics go: sinks behind one interface (metrics.jsonl, TensorBoard, Weights &
Biases), and progress a person can read (ETA and tokens per second; a progress bar on a terminal).

    sinks = open_sinks(cfg.logging, run_config={"num_layers": 4})
    for sink in sinks: sink.write({"iteration": 1, "lm_loss": 5.4, ...})
    for sink in sinks: sink.close()

Every sink receives the same records; TensorBoard and W&B take their scalars under Megatron's names
("lm loss", "grad norm", ...), metrics.jsonl takes every field.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Protocol

# record key -> the scalar's name in TensorBoard and W&B (Megatron writes "lm loss", "lm loss
# validation", ...)
SCALARS = {
    "lm_loss": "lm loss",
    "validation_lm_loss": "validation lm loss",
    "grad_norm": "grad norm",
    "lr": "lr",
    "loss_scale": "loss scale",
    "tokens_per_s": "tokens per s",
    "tflops": "tflops",
    "params_norm": "params norm",
    "global_batch_size": "global batch size",
}


class MetricSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


# the auxiliary losses under megatron-core's names, and their per-layer values under "moe/"
# (--moe-per-layer-logging)
AUX_LOSSES = (
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "z_loss",
    "global_load_balancing_loss",
)


def _display_name(key: str) -> str | None:
    if key in SCALARS:
        return SCALARS[key]
    if key in AUX_LOSSES or (key.startswith("mtp_") and key.endswith(" loss")):
        return key
    if key.partition("_layer_")[0] in AUX_LOSSES:
        return f"moe/{key}"
    return None


def scalars(record: dict) -> dict[str, float]:
    """The record's finite scalars under their display names."""
    named = {key: _display_name(key) for key in record}
    return {
        name: float(record[key])
        for key, name in named.items()
        if name is not None and isinstance(record[key], (int, float)) and record[key] == record[key]
    }


class JsonlSink:
    """DIR/metrics.jsonl, one record per line, flushed as written."""

    def __init__(self, directory: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / "metrics.jsonl"
        self._file = open(self.path, "w")  # noqa: SIM115 - closed by close()

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(directory)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, record["iteration"])

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run (Megatron's --wandb-project, --wandb-exp-name, --wandb-save-dir,
    --wandb-entity); offline, into save_dir/wandb, when no API key is set (WANDB_API_KEY or
    WANDB_MODE)."""

    def __init__(
        self, project: str, name: str | None, save_dir: str, entity: str | None, run_config: dict
    ):
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=save_dir,
            entity=entity,
            config=run_config,
            mode=mode,
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values:
            self._run.log(values, step=record["iteration"])

    def close(self) -> None:
        self._run.finish()


def open_sinks(logging, run_config: dict) -> list[MetricSink]:
    """The sinks the logging configuration asks for (on the rank that logs)."""
    sinks: list[MetricSink] = []
    if logging.log_dir:
        sinks.append(JsonlSink(logging.log_dir))
    if logging.tensorboard_dir:
        sinks.append(TensorBoardSink(logging.tensorboard_dir))
    if logging.wandb_project:
        sinks.append(
            WandbSink(
                logging.wandb_project,
                logging.wandb_exp_name,
                logging.wandb_save_dir or logging.log_dir or ".",
                logging.wandb_entity,
                run_config,
            )
        )
    return sinks


def eta(iterations_left: int, seconds_per_iteration: float) -> str:
    """'1:02:03' for the time the remaining iterations take at the recent pace."""
    return str(datetime.timedelta(seconds=round(max(iterations_left, 0) * seconds_per_iteration)))


class ProgressDisplay:
    """Progress beside Megatron's log line. On a terminal, a progress bar (tqdm) with the ETA and
    tokens/s, above which the log lines are printed; into a file or pipe, the log lines exactly as
    Megatron prints them, each followed by one 'progress:' line with the same ETA and tokens/s."""

    def __init__(self, total: int, first: int, stream=None, recent: int = 20):
        self.stream = stream or sys.stdout
        self.total, self._times, self._recent = total, [], recent
        self._bar = None
        if self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total, initial=first - 1, file=self.stream, unit="it", dynamic_ncols=True
                )

    def seconds_per_iteration(self) -> float:
        times = self._times[-self._recent :]
        return sum(times) / len(times) if times else 0.0

    def step(self, iteration: int, seconds: float, tokens_per_s: float) -> None:
        self._times.append(seconds)
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"ETA {eta(self.total - iteration, self.seconds_per_iteration())}, "
                f"{tokens_per_s:,.0f} tokens/s",
                refresh=False,
            )
            self._bar.update(1)

    def print(self, line: str) -> None:
        """A log line, kept clear of the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def log_line(self, lines: list[str], iteration: int, tokens_per_s: float) -> None:
        """Megatron's log line (and fmeg's timers line), then, unless a bar shows it, the progress
        line."""
        for line in lines:
            self.print(line)
        if self._bar is None:
            print(
                f"    progress: {iteration}/{self.total} iterations, ETA "
                f"{eta(self.total - iteration, self.seconds_per_iteration())}, {tokens_per_s:,.0f} "
                "tokens/s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
