"""The runner's training loop: one iteration at a time through the one step
(parallel_step.train_iteration), with the decisions of fmeg.training.policies, the metric sinks and
the log line.

    trainer = Trainer(cfg, session, state, progress, train_data, valid_data, checkpointer,
        started_at)
    code = trainer.run()        # 0, or 1 when a non-finite step or a failed save stopped the run
"""

from __future__ import annotations

import dataclasses
import math
import resource
import signal
import sys
import time

import torch

from fmeg.log_line import megatron_log_line
from fmeg.ops import fold_in
from fmeg.training import policies
from fmeg.training.metrics import ProgressDisplay, open_sinks
from fmeg.parallel.context import WHOLE_SEQUENCE_KEYS, shard_batch
from fmeg.training.parallel_step import evaluate, global_norm, train_iteration
from fmeg.training.stage_functions import model_parallel
from fmeg.training.step_settings import StepSettings
from fmeg.training.report import draw_loss_curve, model_flops
from fmeg.training.sample_loader import SampleLoader


def collate(samples: list[dict], data) -> dict:
    """The microbatch of samples: tokens, labels and loss_mask, with each row's position_ids under
    --reset-position-ids, its cu_seqlens under --reset-attention-mask and its padding_mask under
    --sft (data: the run's DataConfig)."""
    keys = (
        ("tokens", "labels", "loss_mask")
        + ("position_ids",) * data.reset_position_ids
        + ("cu_seqlens",) * data.reset_attention_mask
        + ("padding_mask",) * data.sft
    )
    return {k: torch.stack([s[k] for s in samples]) for k in keys}


class Trainer:
    def __init__(
        self,
        cfg,
        session,
        state,
        progress: policies.Progress,
        train_data,
        valid_data,
        checkpointer,
        started_at: float,
    ):
        self.cfg, self.session, self.state, self.progress = cfg, session, state, progress
        self.train_data, self.valid_data, self.checkpointer = train_data, valid_data, checkpointer
        self.started_at, self.records, self.losses, self.signalled = started_at, [], [], False
        # where this run began: the final line counts this run apart from the totals
        self.start = progress
        self.context = model_parallel(cfg.layout, session.mesh).context
        # the FP8 plan, with delayed scaling's state (the state's, which checkpoints hold)
        plan = cfg.precision.fp8
        delayed = getattr(state, "fp8", None)
        self.fp8 = dataclasses.replace(plan, state=delayed) if plan is not None else None
        self.loader = SampleLoader(cfg.data.num_workers, self.host_microbatch)
        logs = session.last_rank
        self.sinks = open_sinks(cfg.logging, dict(cfg.arguments)) if logs else []
        self.display = (
            ProgressDisplay(cfg.training.train_iters, progress.iteration + 1) if logs else None
        )
        if cfg.training.exit_signal_handler:
            signal.signal(
                getattr(signal, cfg.training.exit_signal),
                lambda signum, frame: setattr(self, "signalled", True),
            )

    def microbatch_starts(self, first_sample: int, global_batch: int) -> list[int]:
        """The first sample of each of this data-parallel rank's microbatches of the global batch at
        first_sample."""
        layout, dp_rank = self.cfg.layout, self.session.mesh.coord("dp")
        return [
            first_sample + (j * layout.dp + dp_rank) * layout.micro_batch_size
            for j in range(layout.microbatches(global_batch))
        ]

    def host_microbatch(self, dataset, first: int) -> dict:
        """The collated samples first .. first + micro batch size (on the host; a sample loader's
        worker builds it)."""
        return collate(
            [dataset[i] for i in range(first, first + self.cfg.layout.micro_batch_size)],
            self.cfg.data,
        )

    def batches(
        self, dataset, first_sample: int, global_batch: int, iteration: int, train: bool
    ) -> list[dict]:
        """This data-parallel rank's microbatches of the global batch that starts at
        first_sample."""
        layout, dp_rank, out = self.cfg.layout, self.session.mesh.coord("dp"), []
        built = self.loader.get(dataset, self.microbatch_starts(first_sample, global_batch))
        for j, mb in enumerate(built):
            # read by the host: never on the device
            host = {k: mb.pop(k) for k in WHOLE_SEQUENCE_KEYS if k in mb}
            # this cp rank's tokens
            mb = shard_batch({**self.session.to_device(mb), **host}, self.context)
            if train and self.cfg.training.dropout:
                mb["dropout_key"] = fold_in(
                    self.cfg.training.seed, iteration, j * layout.dp + dp_rank
                )
            # the random router logits' key
            experts = self.cfg.model.experts
            if train and experts and experts.router.force_load_balancing:
                mb["router_key"] = fold_in(
                    self.cfg.training.seed, iteration, j * layout.dp + dp_rank, 1
                )
            out.append(mb)
        return out

    def run(self) -> int:
        """Train from the iteration after progress to --train-iters, or until a policy stops the
        run."""
        t, failed = self.cfg.training, 0
        start = time.perf_counter()
        for iteration in range(self.progress.iteration + 1, t.train_iters + 1):
            stop = self.iterate(iteration)
            # a background save that could not be written
            if self.checkpointer and not self.checkpointer.poll():
                failed = 1
                break
            if stop is None and policies.should_evaluate(
                iteration, eval_interval=t.eval_interval, train_iters=t.train_iters
            ):
                self.validate(iteration)
            reason = stop or self.exit_reason(iteration)
            exiting = reason is not None and not reason.startswith("error: ")
            # a repeated signal must not kill the save or
            if exiting and self.cfg.training.exit_signal_handler:
                # the exit after it
                signal.signal(getattr(signal, self.cfg.training.exit_signal), signal.SIG_IGN)
            if stop is None and policies.should_save(
                iteration,
                save=self.cfg.checkpoint.save,
                save_interval=self.cfg.checkpoint.save_interval,
                train_iters=t.train_iters,
                exiting=exiting,
            ):
                if not self.checkpointer.save(self.state, self.progress):
                    failed = 1
                    break
            if reason:
                failed = 0 if exiting else 1
                if self.session.last_rank:
                    print(
                        f"exiting at iteration {iteration}: {reason}" if exiting else reason,
                        file=sys.stdout if exiting else sys.stderr,
                        flush=True,
                    )
                break
        self.loader.close()
        # every exit waits for a background save
        if self.checkpointer and not self.checkpointer.finish():
            failed = 1
        self.finish(time.perf_counter() - start)
        return failed

    def step_settings(self, lr: float, weight_decay: float, decoupled_lr: float | None):
        """This iteration's hyperparameters with the run's step policies."""
        cfg, t = self.cfg, self.cfg.training
        return StepSettings(
            lr=lr,
            weight_decay=weight_decay,
            clip_grad=t.clip_grad,
            check_overflow=t.check_for_nan,
            overlap_grad_reduce=cfg.runtime.overlap_grad_reduce,
            bucket_numel=cfg.runtime.ddp_bucket_size,
            compile=self.session.compile,
            decoupled_lr=decoupled_lr,
            per_token=t.per_token_loss,
            fp8=self.fp8,
            deterministic=t.deterministic,
        )

    def iterate(self, iteration: int) -> str | None:
        """One training iteration; an 'error: ...' line when it stops the run (a non-finite
        step)."""
        cfg, t, p = self.cfg, self.cfg.training, self.progress
        tick = time.perf_counter()
        global_batch = t.batch(p.consumed)
        batch = self.batches(self.train_data, p.consumed, global_batch, iteration, train=True)
        # the next iteration's samples, built while this step runs
        if iteration < t.train_iters:
            following = p.consumed + global_batch
            self.loader.ahead(
                self.train_data, self.microbatch_starts(following, t.batch(following))
            )
        data_ms = (time.perf_counter() - tick) * 1e3
        lr, weight_decay = t.lr(p.scheduled), t.weight_decay(p.scheduled)
        decoupled_lr = t.decoupled_lr(p.scheduled) if t.decoupled_lr else None
        # the scaler this step runs with (the step replaces state.scaler)
        scaler = self.state.scaler
        m = train_iteration(
            self.state,
            batch,
            config=cfg.model,
            layout=cfg.layout,
            mesh=self.session.mesh,
            settings=self.step_settings(lr, weight_decay, decoupled_lr),
        )
        # the step's one read, on the rank that logs
        loss = float(m["loss"]) if self.session.last_rank else None
        non_finite = loss is not None and not math.isfinite(loss)
        stop = policies.non_finite_stop(
            skipped=m["skipped"],
            loss_non_finite=m.get("loss_non_finite", False),
            scaler=scaler,
            check_for_nan=t.check_for_nan,
        )
        self.progress = p.after_step(
            global_batch=global_batch,
            skipped=m["skipped"],
            in_samples=t.schedules_in_samples,
            non_finite=non_finite,
            scaled=scaler is not None,
        )
        params_norm = None
        if cfg.logging.log_params_norm:
            with self.state.all_weights():
                params_norm = float(
                    global_norm(self.state.params, cfg.model, cfg.layout, self.session.mesh)
                )
        if self.session.last_rank:
            elapsed = time.perf_counter() - tick
            self.log_step(
                iteration,
                m,
                loss,
                elapsed,
                data_ms,
                global_batch,
                lr,
                weight_decay,
                m["loss_scale"],
                params_norm,
                decoupled_lr,
            )
        if stop:
            return (
                f"error: iteration {iteration}: {stop} (Megatron's "
                "--check-for-nan-in-loss-and-grad, the default; lower the learning rate, train "
                "with --bf16, or pass --no-check-for-nan-in-loss-and-grad to go on)"
            )
        return None

    def log_step(
        self,
        iteration,
        m,
        loss,
        elapsed,
        data_ms,
        global_batch,
        lr,
        weight_decay,
        scale,
        params_norm,
        decoupled_lr,
    ) -> None:
        cfg, p = self.cfg, self.progress
        grad_norm = float(m["grad_norm"])
        other = {name: float(value) for name, value in m.get("aux_losses", {}).items()}
        per_layer = (
            {name: float(value) for name, value in m.get("aux_losses_per_layer", {}).items()}
            if cfg.logging.moe_per_layer_logging
            else {}
        )
        self.losses.append(loss)
        tokens_per_s = global_batch * cfg.data.seq_length / elapsed
        tflops = model_flops(cfg.model, global_batch, cfg.data.seq_length) / (
            elapsed * 1e12 * self.session.world
        )
        self.emit(
            {
                "iteration": iteration,
                "lm_loss": loss,
                **other,
                "grad_norm": grad_norm,
                "lr": lr,
                "weight_decay": weight_decay,
                "loss_scale": scale,
                "skipped": bool(m["skipped"]),
                "consumed_samples": p.consumed,
                "global_batch_size": global_batch,
                "elapsed_ms": elapsed * 1e3,
                "tokens_per_s": tokens_per_s,
                "tflops": tflops,
                "timers_ms": {"data": data_ms, **m["timers_ms"]},
                **per_layer,
                **({"params_norm": params_norm} if params_norm is not None else {}),
                **({"decoupled_lr": decoupled_lr} if decoupled_lr is not None else {}),
            }
        )
        self.display.step(iteration, elapsed, tokens_per_s)
        if iteration % cfg.logging.log_interval == 0 or iteration == cfg.training.train_iters:
            # TFLOP/s per GPU as Megatron prints it; a CPU's figure means nothing next to a GPU's
            shown = tflops if self.session.device.type == "cuda" else None
            line = megatron_log_line(
                iteration=iteration,
                train_iters=cfg.training.train_iters,
                consumed_samples=p.consumed,
                elapsed_ms=elapsed * 1e3,
                tflops=shown,
                lr=lr,
                global_batch_size=global_batch,
                lm_loss=loss,
                grad_norm=grad_norm,
                loss_scale=scale,
                params_norm=params_norm,
                skipped=p.skipped,
                nans=p.nans,
                other_losses=other,
            )
            timers = " | ".join(f"{k} {v:.1f}" for k, v in self.records[-1]["timers_ms"].items())
            self.display.log_line([line, f"    timers (ms): {timers}"], iteration, tokens_per_s)

    def emit(self, record: dict) -> None:
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)

    def validate(self, iteration: int) -> None:
        """Megatron's validation loss: token losses over tokens across --eval-iters global batches
        and every data-parallel rank."""
        cfg, gbs = self.cfg, self.cfg.global_batch
        total = torch.zeros(2, dtype=torch.float64)
        # validation reads delayed scaling's scales and leaves its amax history as it was
        history = self.fp8.state.history.clone() if self.fp8 and self.fp8.state else None
        for _ in range(cfg.training.eval_iters):
            first = self.progress.valid_consumed
            pair = evaluate(
                self.state.params,
                self.batches(self.valid_data, first, gbs, iteration, train=False),
                config=cfg.model,
                layout=cfg.layout,
                mesh=self.session.mesh,
                compile=self.session.compile,
                use=self.state.use,
                fp8=self.fp8,
            )
            self.progress = dataclasses.replace(self.progress, valid_consumed=first + gbs)
            total += pair.cpu() if pair is not None else 0.0
        if history is not None:
            self.fp8.state.history.copy_(history)
        if self.session.last_rank:
            value = float(total[0] / total[1].clamp_min(1.0))
            self.emit({"iteration": iteration, "validation_lm_loss": value})
            self.display.print(
                f" validation loss at iteration {iteration} | lm loss value: {value:.6E} | lm loss "
                f"PPL: {math.exp(min(value, 50)):.6E} |"
            )

    def exit_reason(self, iteration: int) -> str | None:
        """Why every rank stops after this iteration (any rank's reason stops all), or None."""
        t = self.cfg.training
        reasons = policies.exit_reasons(
            iteration,
            exit_interval=t.exit_interval,
            exit_duration_in_mins=t.exit_duration_in_mins,
            minutes_since_start=(time.time() - self.started_at) / 60,
            signalled=self.signalled,
            signal_name=t.exit_signal,
        )
        if self.session.world > 1 and (
            t.exit_signal_handler or t.exit_duration_in_mins is not None
        ):
            if self.session.any_rank(bool(reasons)) and not reasons:
                reasons.append("another rank is exiting")
        return "; ".join(reasons) or None

    def finish(self, seconds: float) -> None:
        if not self.session.last_rank:
            return
        self.display.close()
        if self.losses:
            tail, p = self.losses[-10:], self.progress
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            device = self.session.device
            gpu = (
                f", of {device} {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB"
                if device.type == "cuda"
                else ""
            )
            resumed = (
                f" (iteration {p.iteration}, {p.consumed} samples in all)"
                if self.start.iteration
                else ""
            )
            print(
                f"done: {len(self.losses)} iterations, {p.consumed - self.start.consumed} samples "
                f"in {seconds:.1f} s{resumed}; lm loss {self.losses[0]:.3f} -> "
                f"{sum(tail) / len(tail):.3f} (mean of the last {len(tail)}); {p.skipped} skipped, "
                f"{p.nans} NaN; peak memory of this process {peak_mb:.0f} MB{gpu}",
                flush=True,
            )
        for sink in self.sinks:
            sink.close()
        if self.cfg.logging.log_dir and self.losses:
            draw_loss_curve(self.records, f"{self.cfg.logging.log_dir}/loss.png")
