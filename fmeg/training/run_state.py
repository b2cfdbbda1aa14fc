"""The runner's training state and its checkpoints: build it as on one device then shard it, restore
it from --load at any layout (each rank reading only the boxes it holds), and save it with --save
(in the background with --async-save).

    state, progress, said = build_or_restore(cfg, session)
    # removes what dead runs left, agrees on this run's token
    saver = Checkpointer(cfg, session)
    # False (one line printed) when some rank could not write
    ok = saver.save(state, progress)
    # after every iteration: completes a background save once written
    ok = saver.poll()
    # at the end: waits for a background save and completes it
    ok = saver.finish()
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import sys
from pathlib import Path

import torch

from fmeg import __version__, checkpoint
from fmeg.checkpoint.load import FORMAT
from fmeg.interop import megatron
from fmeg.models import gpt, saved_config
from fmeg.optim import loss_scale
from fmeg.training import policies
from fmeg.training.fp8_state import fp8_pieces, keeps_fp32_master, read_fp8, with_fp8_state
from fmeg.training.checkpoint_state import (
    KINDS,
    REPLICA_GROUPS,
    count_piece,
    load_requests,
    matrix_regions,
    placements,
    regions,
    replicas,
    save_pieces,
    saved_count,
)
from fmeg.parallel.layout import describe_saved
from fmeg.state.flat import FlatState
from fmeg.training.parallel_step import init_state, initialized_state, local_shapes


class MissingCheckpoint(ValueError):
    """--exit-on-missing-checkpoint and --load holds none."""


def _options(cfg, session) -> dict:
    return {
        "compute_dtype": cfg.precision.compute_dtype,
        "optimizer": cfg.training.optimizer,
        "grad_dtype": cfg.precision.grad_dtype,
        "device": session.device,
        "reshard_after_forward": cfg.runtime.reshard_after_forward,
        "moment_dtypes": cfg.precision.moment_dtypes,
        "fp32_master": bool(cfg.precision.fp8 and cfg.precision.fp8.param_gather)
        and keeps_fp32_master(cfg.layout),
        "scaler": cfg.precision.scaler,
    }


def new_state(cfg, session) -> FlatState:
    """This rank's state, its weights zeros, built from the shapes alone (a checkpoint fills it)."""
    state = init_state(
        local_shapes(cfg.model, cfg.layout, session.mesh),
        cfg.model,
        cfg.layout,
        session.mesh,
        **_options(cfg, session),
    )
    return with_fp8_state(state, cfg, session)


def check_model(ckpt: checkpoint.Checkpoint, config: gpt.GPTConfig) -> dict:
    """The checkpoint's model fields, or a CheckpointError naming the fields that differ from the
    flags."""
    where = str(ckpt.path / checkpoint.METADATA)
    try:
        saved = saved_config.saved_model(ckpt.meta.get("model", {}), where)
    except ValueError as e:
        raise checkpoint.CheckpointError(str(e)) from None
    diff = saved_config.differing(saved, config)
    if diff:
        raise checkpoint.CheckpointError(
            f"{where}: the checkpoint's model differs from the flags in {', '.join(diff)}"
        )
    return saved


def read_state(
    ckpt: checkpoint.Checkpoint, state, cfg, mesh, optimizer: bool, agree=lambda problem: problem
) -> None:
    """Fill this rank's state from ckpt: the weights, and with optimizer the master weights, Adam's
    moments and step count. With --ckpt-fully-parallel-load the ranks holding a buffer alike (a
    part's replica group) each read a 1/n slice of it and all-gather the rest. agree(problem) makes
    the ranks agree on a problem one of them met reading (before any collective), which every rank
    then raises."""
    kinds = KINDS if optimizer else ("params",)
    ranges, gathers = {}, []
    for p, part in enumerate(state.parts) if cfg.checkpoint.fully_parallel_load else ():
        group = REPLICA_GROUPS[p]
        n, r = mesh.size(group), mesh.coord(group)
        for kind, (buffer, runs) in part.buffers().items():
            # a buffer laid out as the whole flat buffer (not a compact nu)
            whole = runs == [(0, buffer.numel(), 0)]
            if n > 1 and kind in kinds and kind not in part.sliced_kinds and whole:
                size = buffer.numel() // n
                ranges[(p, kind)] = (r * size, (r + 1) * size)
                gathers.append((buffer, r, size, mesh.group(group)))
    problem = ""
    try:
        places = placements(state, cfg.model, cfg.layout, mesh)
        boxes = regions(state, places, kinds, ranges=ranges)
        if optimizer:
            boxes += matrix_regions(state, places, mesh)
        ckpt.read(load_requests(ckpt, boxes))
        read_fp8(ckpt, state)
        count = saved_count(ckpt) if optimizer else 0
    except checkpoint.CheckpointError as e:
        problem = str(e)
    problem = agree(problem)
    if problem:
        raise checkpoint.CheckpointError(problem)
    for buffer, index, size, group in gathers:
        _all_gather_into(buffer, index, size, group)
    if optimizer:
        state.set_count(count)


def _all_gather_into(
    buffer: torch.Tensor, index: int, size: int, group, chunk: int = 1 << 22
) -> None:
    """buffer holds this rank's slice [index * size, (index + 1) * size); fill in the other ranks'
    slices from them, a chunk at a time (no copy of the whole buffer)."""
    whole = buffer.view(-1, size)
    for a in range(0, size, chunk):
        gathered = group.all_gather(whole[index, a : a + chunk].contiguous(), 0)
        whole[:, a : a + chunk].copy_(gathered.view(whole.shape[0], -1))


def build_or_restore(cfg, session) -> tuple[FlatState, policies.Progress, list[str]]:
    """This rank's state and the run's progress: initialised as on one device and sharded; or, with
    --load, read from the newest checkpoint there at this layout, as policies.resume says, without
    building the whole model. After torchrun restarted the job, its own newest checkpoint under
    --save is resumed as it is (--finetune and --no-load-optim were for the first start), else
    --load as given. The third value is what the last rank prints about it. CheckpointError and
    MissingCheckpoint are bad input (one line)."""
    ck = cfg.checkpoint
    # restarted: this job's own newest
    own = bool(session.restarts and ck.save and checkpoint.latest(ck.save))
    load = ck.save if own else ck.load
    progress = policies.Progress()
    found = checkpoint.latest(load) if load else None
    if found is None:
        state = initialized_state(
            cfg.model, cfg.layout, session.mesh, seed=cfg.training.seed, **_options(cfg, session)
        )
        state = with_fp8_state(state, cfg, session)
        if load and ck.exit_on_missing_checkpoint:
            raise MissingCheckpoint(
                f"--load {load}: no checkpoint there ({checkpoint.LATEST} missing) and "
                "--exit-on-missing-checkpoint is set; fix the path or drop the flag"
            )
        said = (
            [
                f"--load {load}: no checkpoint there yet ({checkpoint.LATEST} missing); starting "
                "from scratch"
            ]
            if ck.load
            else []
        )
        return state, progress, said
    if megatron.is_megatron(found):
        return _restore_megatron(cfg, session, found, load)
    with checkpoint.Checkpoint.open(found) as ckpt:
        saved = check_model(ckpt, cfg.model)
        layout_meta = cfg.layout.checkpoint_meta(cfg.precision.compute_dtype)
        same = (
            ckpt.meta.get("layout") == layout_meta
            and ckpt.meta["model"].get("padded_vocab_size") == cfg.model.padded_vocab_size
        )
        # written with --no-save-optim
        weights_only = ckpt.meta.get("optimizer_saved") is False
        if weights_only and not own and not (ck.finetune or ck.no_load_optim):
            raise checkpoint.CheckpointError(
                f"--load {load}: {found.name} holds no optimizer state (saved with "
                "--no-save-optim); resume it with --no-load-optim or --finetune"
            )
        if not (weights_only or ck.finetune or ck.no_load_optim):
            _same_optimizer(ckpt.meta, cfg, f"--load {load}: {found.name}")
        saved_layout = describe_saved(ckpt.meta.get("layout"))
        plan = policies.resume(
            ckpt.meta,
            finetune=ck.finetune and not own,
            no_load_optim=weights_only or (ck.no_load_optim and not own),
            in_samples=cfg.training.schedules_in_samples,
            scaler=cfg.precision.scaler,
            layout_note="layout unchanged" if same else f"resharded from {saved_layout}",
            path=str(found),
        )
        state = new_state(cfg, session)
        read_state(
            ckpt,
            state,
            cfg,
            session.mesh,
            optimizer=not plan.fresh_optimizer,
            agree=session.first_problem,
        )
    # the weights only: fp32 main weights from the loaded ones
    if plan.fresh_optimizer:
        state.fresh_optimizer()
    state.scaler = plan.scaler
    changed = [
        f"warning: --load {load}: {change} (a setting outside the parameters' shapes, which may "
        "change on load as in Megatron)"
        for change in saved_config.changed_on_load(saved, cfg.model)
    ]
    restarted = [f"restart {session.restarts}: resuming from --save {ck.save}"] if own else []
    return state, plan.progress, [*restarted, plan.description, *changed]


def _same_optimizer(meta: dict, cfg, where: str) -> None:
    """A CheckpointError unless the checkpoint's optimizer state is the kind this run steps
    (checkpoints from before it was recorded are Adam's)."""
    kind, mine = meta.get("optimizer", "adam"), cfg.training.optimizer.state_kind
    if (kind, mine) == ("lion", "lion+adam"):
        raise checkpoint.CheckpointError(
            f"{where} holds the Lion state fmeg stepped before 2026-12-01 (Lion on every leaf, "
            "--lion-beta1/2); --optimizer lion now steps Megatron-LM's (Lion on the matrices with "
            "--adam-beta1/2, Adam on the rest): start its state fresh with --no-load-optim"
        )
    if kind != mine:
        raise checkpoint.CheckpointError(
            f"{where} holds {kind}'s optimizer state and this run steps {mine}: resume with "
            f"--optimizer {kind.split('+')[0]}, or start {mine}'s state fresh with "
            "--no-load-optim"
        )


def _restore_megatron(
    cfg, session, found: Path, load: str
) -> tuple[FlatState, policies.Progress, list[str]]:
    """The weights of a Megatron-LM torch_dist checkpoint at this layout, with its iteration and
    consumed samples, and, when it holds its distributed optimizer's state (fully or dp
    reshardable) and this run steps Adam, Adam's moments, fp32 master weights and step count (the
    schedules go on from its iteration); otherwise the optimizer and schedules start fresh, as
    --no-load-optim."""
    ck = cfg.checkpoint
    with megatron.MegatronCheckpoint.open(found, cfg.model) as ckpt:
        ckpt.check(cfg.model)
        wanted = not (ck.finetune or ck.no_load_optim)
        optimizer = wanted and ckpt.holds_optimizer_state()
        if optimizer and cfg.training.optimizer.state_kind != "adam":
            _same_optimizer({"optimizer": "adam"}, cfg, f"--load {load}: {found.name}")
        plan = policies.resume(
            ckpt.meta,
            finetune=ck.finetune,
            no_load_optim=not optimizer,
            in_samples=cfg.training.schedules_in_samples,
            scaler=cfg.precision.scaler,
            path=f"{found}, {ckpt.describe()}",
            # (without it the note is the fresh optimizer's)
            layout_note=f"Adam's state at step {ckpt.optimizer_step()}, saved {ckpt.sharding()}",
        )
        state = new_state(cfg, session)
        read_state(ckpt, state, cfg, session.mesh, optimizer=optimizer, agree=session.first_problem)
        why = ckpt.optimizer_unread()
    if not optimizer:
        state.fresh_optimizer()
    state.scaler = plan.scaler
    said = [plan.description]
    if wanted and not optimizer:
        said.append(
            f"warning: --load {load}: {why} (Megatron-LM rewrites it per parameter when it "
            "resumes once with --dist-ckpt-optim-fully-reshardable and --save); the optimizer and "
            "the LR schedule start fresh, as with --no-load-optim"
        )
    return state, plan.progress, said


class Checkpointer:
    """Saves under --save: each rank writes its pieces into a temporary directory named with this
    run's token (a restart never writes into a dead run's), rank 0 renames it into place once every
    rank has written. With --async-save the state is copied to host memory (allocated once, pinned
    on CUDA) and written by a background thread; the next save, the end of the run and every exit
    wait for it, and poll() completes it between iterations once every rank's write is done."""

    def __init__(self, cfg, session):
        self.cfg, self.session, self.root = cfg, session, cfg.checkpoint.save
        self.attempt = f"{session.shared_token(secrets.randbits(48)):012x}"
        self.writer = checkpoint.BackgroundWriter() if cfg.checkpoint.async_save else None
        # (iteration, metadata, bytes) of a background save
        self.pending: tuple[int, dict, int] | None = None
        self.places, self.host, self.max_cell = None, {}, None
        if session.rank == 0:
            for name in checkpoint.remove_stale(self.root):
                print(
                    f"removed {Path(self.root) / name}: an interrupted save's leftovers", flush=True
                )
        session.barrier()

    def _make_room(self) -> None:
        """With --keep-last K and the disk short of room for one more checkpoint: keep K - 1
        first."""
        keep, session = self.cfg.checkpoint.keep_last, self.session
        if not keep or keep < 2:
            return
        if session.rank == 0:
            newest = checkpoint.latest(self.root)
            if newest is not None and shutil.disk_usage(self.root).free < checkpoint.disk_bytes(
                newest
            ):
                for name in checkpoint.prune(self.root, keep - 1):
                    print(
                        f"removed {Path(self.root) / name} before saving: the disk is short of "
                        f"space for --keep-last {keep}",
                        flush=True,
                    )
        session.barrier()

    def pieces(self, state) -> list[checkpoint.Piece]:
        """What this rank writes, as views of host memory: the state's buffers themselves (a
        synchronous save on the CPU) or copies made now (allocated once), which training no longer
        touches."""
        cfg, session = self.cfg, self.session
        if self.places is None:
            self.places = placements(state, cfg.model, cfg.layout, session.mesh)
            held = sum(
                b.numel() * b.element_size()
                for part in state.parts
                for b, _ in part.buffers().values()
            )
            self.max_cell = checkpoint.cell_bytes_for(
                session.first_failure(False, held)[1] // session.world
            )
        fully = cfg.checkpoint.fully_parallel_save
        # --no-save-optim: the weights only
        kinds = ("params",) if cfg.checkpoint.no_save_optim else KINDS
        boxes = regions(state, self.places, kinds)
        if self.writer or session.device.type != "cpu":
            if not self.host:
                for p, kind in {
                    (r.part, r.kind)
                    for r in boxes
                    if replicas(r) and (fully or not replicas(r).index)
                }:
                    buffer = state.parts[p].buffers()[kind][0]
                    self.host[(p, kind)] = torch.empty(
                        buffer.shape, dtype=buffer.dtype, pin_memory=session.device.type == "cuda"
                    )
            for (p, kind), host in self.host.items():
                host.copy_(state.parts[p].buffers()[kind][0], non_blocking=True)
            if session.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            boxes = regions(state, self.places, kinds, buffers=self.host)
        count = [count_piece(state.parts[0].count)] if session.rank == 0 and kinds == KINDS else []
        count += fp8_pieces(state) if session.rank == 0 else []
        if kinds == KINDS:
            # each step replaces these tensors (never writes them): the pieces hold this step's
            boxes += [
                dataclasses.replace(r, view=r.view.cpu())
                for r in matrix_regions(state, self.places, session.mesh)
            ]
        return save_pieces(boxes, fully, self.max_cell) + count

    def save(self, state, progress: policies.Progress) -> bool:
        """Write a checkpoint of this iteration (or start writing it, with --async-save); False (one
        line printed, the partial directory removed, the previous checkpoint untouched) when some
        rank could not write its part, e.g. on a full disk."""
        if not self.finish():
            return False
        cfg, session, iteration = self.cfg, self.session, progress.iteration
        self._make_room()
        pieces = self.pieces(state)
        size = sum(p.values.numel() * p.values.element_size() for p in pieces)
        tmp = checkpoint.temporary_dir(self.root, iteration, self.attempt)
        job = (tmp, session.rank, cfg.layout.coords(session.mesh), pieces)
        if self.writer:
            self.writer.start(_write, *job)
            self.pending = (iteration, self.metadata(progress, state.scaler), size)
            return True
        try:
            _write(*job)
            problem = ""
        except OSError as e:
            problem = _one_line(e)
        return self._complete(iteration, self.metadata(progress, state.scaler), problem, size)

    def poll(self) -> bool:
        """Between iterations: complete a background save once every rank has written its part (one
        all-reduce while one is pending); False as save() when some rank could not."""
        if self.pending is None or self.session.any_rank(not self.writer.done):
            return True
        return self.finish()

    def finish(self) -> bool:
        """Wait for a background save and complete it (every rank; True when none is pending)."""
        if self.pending is None:
            return True
        (iteration, metadata, size), self.pending = self.pending, None
        error = self.writer.wait()
        if error is not None and not isinstance(error, OSError):
            raise error
        return self._complete(iteration, metadata, _one_line(error) if error else "", size)

    def _complete(self, iteration: int, metadata: dict, problem: str, size: int) -> bool:
        session, cfg = self.session, self.cfg
        failed, size = session.first_failure(bool(problem), size)
        if failed < session.world:
            if session.rank == 0:
                shutil.rmtree(
                    checkpoint.temporary_dir(self.root, iteration, self.attempt), ignore_errors=True
                )
            session.barrier()
            if session.rank == failed:
                kept = checkpoint.latest(self.root)
                print(
                    f"error: --save {self.root}: writing iteration {iteration} failed ({problem}); "
                    f"it needs about {size / 2**20:,.0f} MiB and "
                    f"{shutil.disk_usage(self.root).free / 2**20:,.0f} MiB are free; the partial "
                    f"checkpoint was removed and {kept.name if kept else 'no earlier checkpoint'} "
                    "is intact",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        if session.rank == 0:
            checkpoint.finalize(
                self.root,
                iteration,
                metadata,
                keep_last=cfg.checkpoint.keep_last,
                attempt=self.attempt,
            )
        session.barrier()
        if session.last_rank:
            print(
                f"saved checkpoint {checkpoint.iteration_dir(self.root, iteration)}"
                f"{' (written in the background)' if self.writer else ''}",
                flush=True,
            )
        return True

    def metadata(self, progress: policies.Progress, scaler: loss_scale.LossScale | None) -> dict:
        cfg = self.cfg
        return {
            "format": FORMAT,
            "world_size": self.session.world,
            "layout": cfg.layout.checkpoint_meta(cfg.precision.compute_dtype),
            "model": cfg.model.flat(),
            "consumed_samples": progress.consumed,
            "valid_consumed_samples": progress.valid_consumed,
            "scheduler_steps": progress.scheduled,
            "optimizer_saved": not cfg.checkpoint.no_save_optim,
            "optimizer": cfg.training.optimizer.state_kind,
            "loss_scale": dataclasses.asdict(scaler) if scaler else None,
            "arguments": dict(cfg.arguments),
            "fmeg_version": __version__,
        }


def _write(tmp: Path, rank: int, coords: dict, pieces: list) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    checkpoint.write_rank(tmp, rank, coords, pieces)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]
