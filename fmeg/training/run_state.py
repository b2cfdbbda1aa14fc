"""The runner's training state and its checkpoints: build it as on one device then shard it, restore it from
--load at any layout, and save it with --save.

    state, progress, said = build_or_restore(cfg, session)
    saver = Checkpointer(cfg, session)            # removes what dead runs left, agrees on this run's token
    ok = saver.save(state, progress)              # False (one line printed) when some rank could not write
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import sys
from pathlib import Path

from safetensors import SafetensorError

from fmeg import __version__, checkpoint, optim, tree
from fmeg.models import gpt
from fmeg.training import policies
from fmeg.training.flat_state import FlatState
from fmeg.training.parallel_step import init_state, shard_params


class MissingCheckpoint(ValueError):
    """--exit-on-missing-checkpoint and --load holds none."""


def new_state(cfg, session, fp32_params) -> FlatState:
    return init_state(fp32_params, cfg.model, cfg.layout, session.mesh, distributed=cfg.layout.zero,
                      compute_dtype=cfg.precision.compute_dtype, adam=cfg.training.adam,
                      grad_dtype=cfg.precision.grad_dtype)


def _resharded(path, meta, cfg, session, state: FlatState):
    """A checkpoint of another layout, for this rank, as state.load takes it: full tensors rebuilt from every
    shard, then cut the way this layout cuts them (tensor-parallel shards of this rank's stages and, with
    the distributed optimizer, its slice of the flat layout)."""
    full = checkpoint.full_state(path, meta, cfg.model)
    master = "main" if "main" in full else "params"  # the fp32 weights, when the checkpoint has them

    def local(name):
        trees = session.to_device(shard_params(full[name], cfg.model, cfg.layout, session.mesh))
        return state.zero_slices(trees) if state.zero else trees

    weights = session.to_device(shard_params(full[master], cfg.model, cfg.layout, session.mesh))
    return weights, {"adam": optim.AdamState(full["count"], local("mu"), local("nu")), "main": local(master)}


def build_or_restore(cfg, session) -> tuple[FlatState, policies.Progress, list[str]]:
    """This rank's state and the run's progress: initialised as on one device and sharded, then, with
    --load, overwritten by the newest checkpoint there (resharded when its layout differs) as
    policies.resume says. The third value is what the last rank prints about it. CheckpointError and
    MissingCheckpoint are bad input (one line)."""
    fresh = session.to_device(shard_params(gpt.init(cfg.model, cfg.training.seed), cfg.model, cfg.layout,
                                           session.mesh))
    state, progress = new_state(cfg, session, fresh), policies.Progress(scaler=cfg.precision.scaler)
    ck = cfg.checkpoint
    if not ck.load:
        return state, progress, []
    found = checkpoint.latest(ck.load)
    meta = checkpoint.read_metadata(found, cfg.model) if found else None
    if meta is None:
        if ck.exit_on_missing_checkpoint:
            raise MissingCheckpoint(f"--load {ck.load}: no checkpoint there ({checkpoint.LATEST} missing) and "
                                    "--exit-on-missing-checkpoint is set; fix the path or drop the flag")
        return state, progress, [f"--load {ck.load}: no checkpoint there yet ({checkpoint.LATEST} missing); "
                                 "starting from scratch"]
    layout_meta = cfg.layout.checkpoint_meta(cfg.precision.compute_dtype)
    same = checkpoint.same_layout(meta, layout_meta, cfg.model)
    if same:
        state.load(*session.to_device(checkpoint.local_state(found, meta, cfg.layout.coords(session.mesh))))
    else:
        state.load(*_resharded(found, meta, cfg, session, state))
    plan = policies.resume(meta, finetune=ck.finetune, no_load_optim=ck.no_load_optim,
                           in_samples=cfg.training.schedules_in_samples, scaler=cfg.precision.scaler,
                           layout_note="layout unchanged" if same else f"resharded from {meta['layout']}",
                           path=str(found))
    if plan.fresh_optimizer:  # the weights only: fp32 main weights from the loaded ones
        state = new_state(cfg, session, tree.tree_map(lambda x: x.float(), state.params))
    changed = [f"warning: --load {ck.load}: {change} (a setting outside the parameters' shapes, which may "
               "change on load as in Megatron)" for change in checkpoint.changed_on_load(meta, cfg.model)]
    return state, plan.progress, [plan.description, *changed]


class Checkpointer:
    """Saves under --save: each rank writes its shard into a temporary directory named with this run's token
    (a restart never writes into a dead run's), rank 0 renames it into place once every rank has written."""

    def __init__(self, cfg, session):
        self.cfg, self.session, self.root = cfg, session, cfg.checkpoint.save
        self.attempt = f"{session.shared_token(secrets.randbits(48)):012x}"
        if session.rank == 0:
            for name in checkpoint.remove_stale(self.root):
                print(f"removed {Path(self.root) / name}: an interrupted save's leftovers", flush=True)
        session.barrier()

    def _make_room(self) -> None:
        """With --keep-last K and the disk short of room for one more checkpoint: keep K - 1 first."""
        keep, session = self.cfg.checkpoint.keep_last, self.session
        if not keep or keep < 2:
            return
        if session.rank == 0:
            newest = checkpoint.latest(self.root)
            if newest is not None and shutil.disk_usage(self.root).free < checkpoint.disk_bytes(newest):
                for name in checkpoint.prune(self.root, keep - 1):
                    print(f"removed {Path(self.root) / name} before saving: the disk is short of space for "
                          f"--keep-last {keep}", flush=True)
        session.barrier()

    def save(self, state: FlatState, progress: policies.Progress) -> bool:
        """Write a checkpoint of this iteration; False (one line printed, the partial directory removed, the
        previous checkpoint untouched) when some rank could not write its part, e.g. on a full disk."""
        cfg, session, iteration = self.cfg, self.session, progress.iteration
        everything = checkpoint.state_tensors(state.params, state.opt_state)
        coords = cfg.layout.coords(session.mesh)
        mine = checkpoint.written_here(list(everything), coords, cfg.layout.experts_apart)
        tensors = {n: everything[n] for n in mine}
        self._make_room()
        problem = ""
        try:
            checkpoint.save_rank(self.root, iteration, session.rank, coords, tensors, sizes=cfg.layout.sizes(),
                                 attempt=self.attempt, order=list(everything))
        except (OSError, SafetensorError) as e:
            problem = " ".join(str(e).split())[:300]
        failed, size = session.first_failure(bool(problem), sum(t.numel() * t.element_size() for t in tensors.values()))
        if failed < session.world:
            if session.rank == 0:
                shutil.rmtree(checkpoint.temporary_dir(self.root, iteration, self.attempt), ignore_errors=True)
            session.barrier()
            if session.rank == failed:
                kept = checkpoint.latest(self.root)
                print(f"error: --save {self.root}: writing iteration {iteration} failed ({problem}); it needs about "
                      f"{size / 2**20:,.0f} MiB and {shutil.disk_usage(self.root).free / 2**20:,.0f} MiB are "
                      f"free; the partial checkpoint was removed and "
                      f"{kept.name if kept else 'no earlier checkpoint'} is intact", file=sys.stderr, flush=True)
            return False
        if session.rank == 0:
            checkpoint.finalize(self.root, iteration, self.metadata(progress), keep_last=cfg.checkpoint.keep_last,
                                attempt=self.attempt)
        session.barrier()
        if session.last_rank:
            print(f"saved checkpoint {checkpoint.iteration_dir(self.root, iteration)}", flush=True)
        return True

    def metadata(self, progress: policies.Progress) -> dict:
        cfg = self.cfg
        return {"world_size": self.session.world, "layout": cfg.layout.checkpoint_meta(cfg.precision.compute_dtype),
                "model": dataclasses.asdict(cfg.model), "consumed_samples": progress.consumed,
                "valid_consumed_samples": progress.valid_consumed, "scheduler_steps": progress.scheduled,
                "loss_scale": dataclasses.asdict(progress.scaler) if progress.scaler else None,
                "arguments": dict(cfg.arguments), "fmeg_version": __version__}
