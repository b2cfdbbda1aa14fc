"""This rank's training state in contiguous buffers allocated once; the pytrees are views of them.

    state = FlatState(params, counted, sharding="optim", dp=dp, dp_rank=r, compute_dtype=bf16,
        optimizer=adamw())
    # weights of the leaves given (others meta): the model built a unit at a time
    state.assign(unit)
    state.params, state.opt_state        # {stage: tree} views of the buffers
    with state.use(stage, ("layers.3",)):   # a segment's weights readable (gathered when sharded)
    # what checkpoints save and load (fmeg.training.checkpoint_state)
    state.buffers(), state.leaves()
    # backward accumulates into it: the dp mean gradient in state.grad
    sync = state.grad_sync(dp_group, ...)
    g = state.main_grad()                   # the owned slice in fp32 (unscale it here)
    # in place; nothing allocated to keep
    norm = state.step(mesh, lr=lr, weight_decay=wd, clip_grad=1.0)

dp counts the ranks that hold the same weights and average their gradients: Megatron's data-parallel
group with context parallelism, dp x cp (the runner's mesh group dp_cp). Every buffer is laid out as
zero.FlatBuffer lays out this rank's {stage: tree} (leaves in tree order; with any sharding but
no_shard cut into units, unit_of's layers, each padded to a multiple of dp). With any sharding but
no_shard this rank owns the rank-th 1/dp of every unit (its chunks, as Megatron-FSDP and FSDP2
shard); the sharding (Megatron-FSDP's strategies, SHARDINGS) says which buffers hold only those
owned elements (the "slice"), its chunks in unit order:

                                      no_shard   optim (ZeRO-1)  optim_grads   optim_grads_params
    weights  compute dtype            whole      whole           whole
        slice (units gathered to use)
    grad     grad_dtype: fp32, or     whole      whole           slice         slice
             fp16/bf16 (Megatron's fp16 default, --grad-reduce-in-bf16)
    grad32   fp32 copy of a half-precision grad's owned part (main_grad())
    main     fp32 master weights      whole      slice           slice
        slice (absent in fp32)
    mu, nu   fp32 Adam moments        whole      slice           slice         slice
             (nu of the matrix optimizers: the non-matrix leaves' elements only, one after another)

state.params are views of the weights, or with optim_grads_params of per-unit buffers that
ShardedParams fills inside state.use(). Persistent bytes per parameter at bf16: 18 (2 + 4 + 4 + 8),
2 + 4 + 12 / dp (optim), 2 + 16 / dp (optim_grads), 18 / dp (optim_grads_params); at fp32, 16, 4 + 4
+ 8 / dp, 4 + 12 / dp, 16 / dp. A half-precision grad saves 2 (or 2 / dp) and its fp32 copy costs 4
/ dp (4 whole). The step is the same few whole-buffer ops whatever the number of leaves: the global
norm (one foreach norm over the owned pieces of the leaves, each parameter counted once), then
torch's fused AdamW kernel over the owned slice (fmeg.optim.adamw's flat form), one call per
(learning rate, weight decay or not) group, with the clip as its grad_scale (a device tensor: no
host sync, no pass of its own) and the decoupled weight decay inside it, and the refresh of the
compute weights from the master (optim and optim_grads: an all-gather per unit).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from fmeg import tree
from fmeg import optim
from fmeg.optim.loss_scale import scaler_of
from fmeg.parallel.data_parallel import GradSync
from fmeg.parallel.exact import fixed_point_total
from fmeg.parallel.sharded_grads import ShardedGradSync
from fmeg.parallel.sharded_params import ShardedParams
from fmeg.parallel.zero import FlatBuffer, OwnedView
from fmeg.state.matrix_step import LeafGather, LocalOnly, MatrixStep
from fmeg.state.protocol import step_parts

# What each data-parallel rank keeps a slice of (Megatron-FSDP's --data-parallel-sharding-strategy):
# nothing, the optimizer state (ZeRO-1, --use-distributed-optimizer), also the gradients, also the
# compute weights.
SHARDINGS = ("no_shard", "optim", "optim_grads", "optim_grads_params")


# reshard_after_forward -> keep_after_forward(unit): which gathered units stay from their forward to
# their backward
KEEP_AFTER_FORWARD = {
    "true": lambda unit: False,
    "false": lambda unit: True,
    "auto": lambda unit: unit.split(".")[1] != "layers",
}


def unit_of(path: str) -> str:
    """The unit of sharded gradients' buckets and gathered weights a leaf ("stage.path") belongs to:
    its layer ("0.layers.3"), the word embeddings ("0.embedding.word": a unit of the size of the
    tied output copy, whose chunks are summed with its chunks), or its top-level part
    ("0.embedding" for the position embeddings, "1.final_norm", "1.output")."""
    parts = path.split(".")
    tied = parts[1:3] == ["embedding", "word"]
    return ".".join(parts[:3] if parts[1] == "layers" or tied else parts[:2])


class FlatState:
    """The training-state protocol (fmeg.state.protocol) over one set of flat buffers."""

    # --fp8-param-gather's fmeg.fp8.param_gather.Fp8ParamGather (the runner sets it)
    fp8_gather = None

    def __init__(
        self,
        params: dict[int, Any],
        counted: Callable[[str, torch.Tensor], bool],
        *,
        sharding: str,
        dp: int,
        dp_rank: int,
        compute_dtype: torch.dtype,
        optimizer: optim.GradientTransformation | None = None,
        grad_dtype: torch.dtype = torch.float32,
        dp_group: Any = None,
        device: Any = None,
        reshard_after_forward: str = "true",
        gather: LeafGather | None = None,
        replica_group: Any = None,
        fp32_master: bool = False,
    ):
        """params: this rank's fp32 {stage: tree}, or its shapes (meta tensors: the weights are then
        zeros until assign() fills them, a unit at a time, or a checkpoint is read); counted(path,
        leaf): whether the leaf counts toward the global norm here (tensor-parallel replicas and the
        tied output copy count once); optimizer: the optimizer stepped in place, by its flat form
        (default optim.adamw(): its decay mask, its decoupled leaves, its moments' dtypes);
        grad_dtype: the dtype gradients are accumulated and reduced in; sharding: what is sliced
        over dp (SHARDINGS); dp_group: the group the weights are gathered over (optim_grads_params);
        device: the buffers' (default: the params'); reshard_after_forward (optim_grads_params):
        "true" frees every gathered unit after its forward, "false" keeps every one until its
        backward, "auto" keeps the embedding and the head (torch's fully_shard default: its root
        module's); gather: each matrix leaf's local block to the whole leaf and back (the matrix
        optimizers', fmeg.state.matrix_step; default: leaves are whole here); replica_group: the
        ranks holding the same slices (hybrid sharding's instances; None: none); fp32_master: a
        master buffer even when computing in fp32 (the compute weights then may differ from it)."""
        if sharding not in SHARDINGS:
            raise ValueError(f"FlatState: sharding {sharding!r}, expected one of {SHARDINGS}")
        self.sharding = sharding
        self.shard_grads = sharding in ("optim_grads", "optim_grads_params")
        self.shard_params = sharding == "optim_grads_params"
        self.zero = sharding != "no_shard"
        self.flat = FlatBuffer.of(params, dp, unit_of if self.zero else None)
        self.optimizer = optimizer = optimizer or optim.adamw()
        if optimizer.flat is None:
            raise ValueError(
                "FlatState steps an optimizer's flat form (as optim.adamw() carries); "
                "this optimizer has none"
            )
        moment_dtypes = optimizer.flat.moment_dtypes
        self.kinds = getattr(optimizer.flat, "kinds", ("mu", "nu"))
        self.dp_group, self._gather = dp_group, gather or LocalOnly()
        self.replica_group = replica_group
        # the loss scaler's state (None: no scaling), part of the optimizer's like the moments
        self.scaler = scaler_of(optimizer)
        # the owned elements' number
        self.size = self.flat.padded // dp if self.zero else self.flat.padded
        self.dp, self.dp_rank = dp, dp_rank
        self._where = {
            path: (start, leaf.numel())
            for (path, leaf), start in zip(tree.items(params), self.flat.starts)
        }
        device = tree.tree_leaves(params)[0].device if device is None else torch.device(device)
        self._allocate(device, compute_dtype, grad_dtype, moment_dtypes, fp32_master)
        self.assign(params)
        self.count, self.steps = torch.zeros((), dtype=torch.int64), 0
        # the fused kernel's step count, on the device
        self._step = torch.zeros((), device=device)
        self.gathered = (
            ShardedParams(
                params,
                self.weights,
                dp_group,
                dp=dp,
                rank=dp_rank,
                unit_of=unit_of,
                keep_after_forward=KEEP_AFTER_FORWARD[reshard_after_forward],
            )
            if self.shard_params
            else None
        )
        self.params = self.gathered.params if self.gathered else self.flat.views(self.weights)
        self._index_the_step(params, counted, device)

    def _allocate(
        self,
        device: Any,
        compute_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        moment_dtypes: tuple[torch.dtype, torch.dtype],
        fp32_master: bool = False,
    ) -> None:
        """The buffers, once: whole or this rank's slice as the sharding says."""
        owned = self.size
        weights = owned if self.shard_params else self.flat.padded
        self.weights = torch.zeros(weights, device=device, dtype=compute_dtype)
        grad = owned if self.shard_grads else self.flat.padded
        self.grad = torch.zeros(grad, device=device, dtype=grad_dtype)
        mixed = compute_dtype != torch.float32 or fp32_master
        self.main = torch.zeros(owned, device=device) if mixed else None
        self.grad32 = torch.zeros(owned, device=device) if grad_dtype != torch.float32 else None
        self.mu = torch.zeros(owned, device=device, dtype=moment_dtypes[0])
        # SGD, Lion and Muon over Lion keep one buffer per parameter; Muon's and SOAP's matrices
        # need no second moment (adaptive Muon's do): nu then holds the other leaves' only, laid
        # out once their pieces are known (_index_the_step)
        self.nu, self._nu_runs, self._nu_dtype = None, None, moment_dtypes[1]
        matrix_kinds = getattr(self.optimizer.flat, "matrix_kinds", ("mu", "nu"))
        self._compact_nu = "nu" in self.kinds and "nu" not in matrix_kinds
        if "nu" in self.kinds and not self._compact_nu:
            self.nu = torch.zeros(owned, device=device, dtype=moment_dtypes[1])

    def _index_the_step(self, params: dict[int, Any], counted: Callable, device: Any) -> None:
        """The views the step reads, made once so that it slices nothing: the owned gradient's
        pieces for the norm with their counted weights, and each optimizer group's runs."""
        pieces = self._owned_pieces(params)
        self._owned_grad = owned_grad = (
            self.grad32 if self.grad32 is not None else self._owned(self.grad)
        )
        self._norm_pieces = [owned_grad[a:b] for _, _, a, b, _ in pieces]
        self._norm_weight = torch.tensor(
            [float(counted(path, leaf)) for path, leaf, _, _, _ in pieces],
            dtype=torch.float64,
            device=device,
        )
        master = self.master
        self._groups = self._adam_groups(pieces)
        self._matrices = MatrixStep.of(
            self.optimizer.flat,
            params,
            self._where,
            pieces,
            gather=self._gather,
            dp_group=self.dp_group,
            dp=self.dp,
            dp_rank=self.dp_rank,
            layout=self.flat,
            sliced=self.zero,
            device=device,
        )
        self._has_matrices = bool(self._matrices.leaves)
        self._groups.pop("muon", None)
        nu_at = self._lay_out_compact_nu(pieces, device) if self._compact_nu else None
        moments = (self.mu, self.nu if self.nu is not None else self.mu)

        def view(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            if nu_at is not None and t is self.nu:
                return t[nu_at[a] : nu_at[a] + b - a]
            return t[a:b]

        # made once: the step slices nothing
        self._adam_views = {
            group: [[view(t, a, b) for a, b in runs] for t in (master, owned_grad, *moments)]
            for group, runs in self._groups.items()
        }
        self._adam_steps = {group: [self._step] * len(runs) for group, runs in self._groups.items()}

    def _lay_out_compact_nu(self, pieces: list, device: Any) -> dict[int, int]:
        """nu for the leaves outside the matrix group only, their owned pieces one after another;
        returns {owned start of a piece: its position in nu} (the scalar groups' runs start at
        pieces and are contiguous in it) and sets the checkpoint runs."""
        at, runs, size = {}, [], 0
        for path, leaf, a, b, flat_start in pieces:
            if self.optimizer.flat.group(path, leaf) == "muon":
                continue
            at[a] = size
            runs.append((flat_start, flat_start + b - a, size))
            size += b - a
        self.nu = torch.zeros(size, device=device, dtype=self._nu_dtype)
        self._nu_runs = runs
        return at

    def _owned(self, buffer: torch.Tensor) -> Any:
        """This rank's owned elements of a buffer laid out whole (an OwnedView of it; with one unit
        a plain view) or already only them."""
        if buffer.numel() == self.size:
            return buffer
        view = OwnedView(buffer, self.flat, self.dp_rank)
        return view.chunks[0] if len(view.chunks) == 1 else view

    def _owned_copy(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's owned elements of a buffer laid out whole (a copy, but with one unit) or
        already only them (itself)."""
        return buffer if buffer.numel() == self.size else self.flat.shard(buffer, self.dp_rank)

    def owned_pieces(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """[(flat lo, flat hi, owned position of lo)]: the owned parts of the flat range [start,
        start + n)."""
        if not self.zero:
            return [(start, start + n, start)] if n else []
        return self.flat.owned_pieces(start, n, self.dp_rank)

    @torch.no_grad()
    def assign(self, values: dict[int, Any]) -> None:
        """Set the weights (and the fp32 master) of the leaves of values ({stage: tree} shaped as
        params) that are not meta tensors to them, the part held here only: the model can be built a
        unit at a time, every other unit a meta tensor, without its whole copy on any rank. The
        optimizer's moments are left as they are."""
        for path, leaf in tree.items(values):
            if leaf.is_meta:
                continue
            start, n = self._where[path]
            flat = leaf.reshape(-1)
            if not self.shard_params:
                self.weights[start : start + n].copy_(flat)
            for a, b, at in self.owned_pieces(start, n):
                piece = flat[a - start : b - start]
                if self.shard_params:
                    self.weights[at : at + b - a].copy_(piece)
                if self.main is not None:
                    self.main[at : at + b - a].copy_(piece)

    def grad_sync(
        self,
        group: Any,
        *,
        replicated: frozenset[str] = frozenset(),
        bucket_numel: int | None = None,
        overlap: bool = False,
        divisor: int | None = None,
        exact: bool = False,
    ) -> GradSync:
        """The data-parallel gradient reduction into self.grad (ZeRO-1: into this rank's slice), the
        sum over group divided by divisor (default: the group's size), ready for an iteration: built
        on first use and reset on every later call with the same arguments. exact: the sums in
        fmeg.parallel.exact's accumulator (--deterministic-mode)."""
        key = (group, replicated, bucket_numel, overlap, divisor, exact)
        cached = getattr(self, "_grad_sync", None)
        if cached is not None and cached[0] == key:
            return cached[1].reset()
        if self.shard_grads:
            sync = ShardedGradSync(
                self.params,
                group,
                self.grad,
                unit_of=unit_of,
                replicated=replicated,
                divisor=divisor,
                replicas=self.replica_group,
                exact=exact,
            )
        else:
            sync = GradSync(
                self.params,
                group,
                owner_slices=self.zero,
                bucket_numel=bucket_numel,
                replicated=replicated,
                buffer=self.grad,
                overlap=overlap,
                divisor=divisor,
                replicas=self.replica_group,
                unit_of=unit_of,
                exact=exact,
            )
        self._grad_sync = (key, sync)
        return sync

    def main_grad(self) -> torch.Tensor:
        """The owned slice of the gradient in fp32, which step() reads: a view of grad, or (a
        half-precision grad) its fp32 copy, refreshed here; unscaling and overflow checks belong on
        it, in fp32."""
        if self.grad32 is not None:
            self.grad32.copy_(self._owned_copy(self.grad))
        return self._owned_grad

    def _adam_groups(self, pieces: list) -> dict[tuple[bool, bool], list[tuple[int, int]]]:
        """{(decoupled learning rate?, weight decay?): [(start, end)]}: the owned pieces cut into
        maximal runs of neighbouring leaves that share both, each group one fused AdamW call."""
        runs: list[list] = []
        for path, leaf, a, b, at in pieces:
            group = self.optimizer.flat.group(path, leaf)
            # neighbours in the owned elements and in the flat buffers (one chunk)
            if runs and runs[-1][2:] == [group, at - a] and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b, group, at - a])
        groups: dict[tuple[bool, bool], list[tuple[int, int]]] = {}
        for a, b, group, _ in runs:
            groups.setdefault(group, []).append((a, b))
        return groups

    def _owned_pieces(self, params: dict[int, Any]) -> list[tuple[str, Any, int, int, int]]:
        """(path, leaf, start, end, flat start) for every leaf's owned parts, start and end in owned
        coordinates."""
        return [
            (path, leaf, at, at + b - a, a)
            for path, leaf in tree.items(params)
            for a, b, at in self.owned_pieces(*self._where[path])
        ]

    @property
    def leaf_ranges(self) -> dict[str, tuple[int, int]]:
        """{"stage.path": (its first element in the flat buffers, its number of elements)}."""
        return self._where

    @property
    def master(self) -> torch.Tensor:
        """The fp32 weights the optimizer updates: main, or (fp32 compute) the owned part of
        weights."""
        return self.main if self.main is not None else self._owned(self.weights)

    @property
    def opt_state(self) -> dict:
        """{"adam": AdamState(count, mu, nu), "main"?: ...}: trees of views, or {"shard": slice}
        with ZeRO-1."""
        as_tree = (lambda t: {"shard": t}) if self.zero else self.flat.views
        if self._compact_nu:
            # the matrix optimizers' nu: a flat buffer of the other leaves' moments only
            nu = {"compact": self.nu}
        else:
            nu = None if self.nu is None else as_tree(self.nu)
        name = getattr(self.optimizer.flat, "name", "adam")
        state = {name: optim.AdamState(self.count, as_tree(self.mu), nu)}
        if self.main is not None:
            state["main"] = as_tree(self.main)
        return state

    def persistent_bytes(self) -> int:
        """The bytes of every buffer allocated once: weights, gradients, master weights,
        moments."""
        buffers = [self.weights, self.grad, self.mu] + [
            b for b in (self.nu, self.main, self.grad32) if b is not None
        ]
        held = tree.tree_leaves([state for state, _ in self.matrix_states().values()])
        return sum(b.numel() * b.element_size() for b in [*buffers, *held])

    def bytes_per_parameter(self) -> float:
        return self.persistent_bytes() / self.flat.numel

    @property
    def parts(self) -> tuple["FlatState", ...]:
        return (self,)

    @property
    def sliced_kinds(self) -> frozenset[str]:
        """The buffers() kinds held as this rank's owned elements rather than whole."""
        if not self.zero:
            return frozenset()
        return frozenset({"main", *self.kinds} | ({"params"} if self.shard_params else set()))

    def use(self, stage: int, keys: tuple[str, ...] | None, backward: bool = False):
        """A context in which a segment's weights (keys inside stage; None: all of it) can be read:
        gathered with sharded weights (ShardedParams.use), always readable otherwise."""
        return (
            self.gathered.use(stage, keys, backward) if self.gathered else contextlib.nullcontext()
        )

    def all_weights(self):
        """A context in which every weight of state.params can be read."""
        return self.gathered.everything() if self.gathered else contextlib.nullcontext()

    def end_iteration(self) -> None:
        if self.gathered:
            self.gathered.end_iteration()

    def leaves(self) -> list[tuple[str, torch.Size, int]]:
        """(stage.path, local shape, flat start) of every leaf, in the buffers' order."""
        return [
            (path, shape, self._where[path][0])
            for path, shape in zip(self._where, self.flat.shapes)
        ]

    def buffers(self) -> dict[str, tuple[torch.Tensor, list[tuple[int, int, int]]]]:
        """What checkpoints save and load, by kind, each with its runs [(flat lo, flat hi, position
        in the buffer of lo)]: params (the compute weights, whole), main (fp32 master weights;
        absent in fp32, where the weights are the master), mu and nu (Adam's moments); the last
        three are the owned elements (its chunks) with ZeRO-1."""
        whole = [(0, self.flat.padded, 0)]
        owned = (
            [(*self.flat.chunk(u, self.dp_rank), at) for u, at in enumerate(self.flat.chunk_starts)]
            if self.zero
            else whole
        )
        out = {
            "params": (self.weights, owned if self.shard_params else whole),
            "mu": (self.mu, owned),
        }
        if self.nu is not None:
            out["nu"] = (self.nu, self._nu_runs if self._compact_nu else owned)
        if self.main is not None:
            out["main"] = (self.main, owned)
        return out

    def set_count(self, count: int) -> None:
        """The optimizer's step count (a checkpoint's)."""
        self.count.fill_(count)
        self.steps = count

    @torch.no_grad()
    def fresh_optimizer(self) -> None:
        """The optimizer state a new run starts with, for the weights held now: the master from the
        weights, zero moments, step count 0 (--finetune, --no-load-optim)."""
        if self.main is not None:
            self.main.copy_(self._owned_copy(self.weights))
        self.mu.zero_()
        if self.nu is not None:
            self.nu.zero_()
        self.set_count(0)

    @torch.no_grad()
    def step(
        self,
        mesh: Any,
        *,
        lr: float,
        weight_decay: float,
        clip_grad: float,
        decoupled_lr: float | None = None,
        exact: bool = False,
    ) -> torch.Tensor:
        """Global norm of the owned gradient (returned, a device tensor), clip, AdamW on the owned
        slice, then the compute weights from the master. The owned gradient is main_grad()'s, taken
        after the data-parallel mean (GradSync.finish). decoupled_lr: the learning rate of the
        leaves marked decoupled (default lr); exact: the norm's sum of squares by
        fmeg.parallel.exact (the same bits for any split of the gradient over ranks)."""
        # the slices of one instance (their replicas hold the same gradient)
        groups = ("dp_cp_shard", "mp") if self.zero else ("mp",)
        norm = self.norm_squared(mesh, groups, exact).sqrt()
        return step_parts(
            (self,),
            (self.dp_group,),
            norm,
            clip_grad=clip_grad,
            lr=lr,
            weight_decay=weight_decay,
            decoupled_lr=decoupled_lr,
            exact=exact,
        )

    def norm_squared(self, mesh: Any, groups: tuple[str, ...], exact: bool = False) -> torch.Tensor:
        """The squared norm of the owned gradient, each parameter counted once, summed over mesh's
        groups; exact: by fixed_point_total (a float32 element's square is exact in float64)."""
        if exact:
            squares = [
                piece.to(torch.float64).square()
                for piece, weight in zip(self._norm_pieces, self._norm_weight.tolist())
                if weight
            ]
            return fixed_point_total(squares, tuple(mesh.group(name) for name in groups))
        total = torch.zeros((), dtype=torch.float64, device=self.grad.device)
        if self._norm_pieces:
            # accumulated in fp64: a leaf's norm from its slices' is then its whole norm but for
            # fp64's rounding, so the clip is the same fp32 number at every sharding
            norms = torch.stack(torch._foreach_norm(self._norm_pieces, 2, dtype=torch.float64))
            total = (norms.square() * self._norm_weight).sum()
        for name in groups:
            group = mesh.group(name)
            total = group.all_reduce(total) if group is not None else total
        return total

    def update(
        self,
        grad_scale: torch.Tensor | None,
        *,
        lr: float,
        weight_decay: float,
        decoupled_lr: float | None = None,
        exact: bool = False,
    ) -> None:
        """The optimizer's flat form on the owned slice, the gradient divided by grad_scale (the
        clip); exact: its elementwise results the same however the buffer is sliced (Adam's)."""
        self.steps += 1
        self.count.fill_(self.steps)
        self._step.fill_(self.steps)
        for group, views in self._adam_views.items():
            self.optimizer.flat.step_(
                views,
                self._adam_steps[group],
                group,
                lr=lr,
                weight_decay=weight_decay,
                decoupled_lr=decoupled_lr,
                grad_scale=grad_scale,
                **({"exact": True} if exact else {}),
            )
        if self._has_matrices:
            self._matrices.run(
                self.optimizer.flat,
                self.master,
                self.mu,
                None if self._compact_nu else self.nu,
                self._owned_grad,
                grad_scale,
                lr=lr,
                weight_decay=weight_decay,
            )

    def refresh(self, dp_group: Any) -> None:
        """The compute weights from the master (with ZeRO-1, every unit's chunks all-gathered over
        dp_group, one all-gather per unit; with sharded weights, the owned chunks only: units are
        gathered when used)."""
        if self.gathered is not None:
            if self.fp8_gather is not None:
                self.fp8_gather.forget()
            if self.main is not None:
                self.weights.copy_(self.main)
        elif self.zero and dp_group is not None and self.fp8_gather is not None:
            self.fp8_gather.refresh(self.master, self.weights, dp_group)
        elif self.zero and dp_group is not None:
            master, handles = self.master, []
            for u, first in enumerate(self.flat.chunk_starts):
                a, b = self.flat.units[u]
                # a copy: in fp32 the chunk is a view of the unit gathered into
                mine = master[first : first + (b - a) // self.dp].to(self.weights.dtype, copy=True)
                handles.append(dp_group.all_gather_into_async(self.weights[a:b], mine))
            for handle in handles:
                handle.wait()
        elif self.main is not None:
            self.weights.copy_(self.main)

    @torch.no_grad()
    def add_(self, path: str, delta: torch.Tensor) -> None:
        """leaf `path` ("stage.path") += delta outside the optimizer (Megatron's expert-bias
        update), in the compute weights and in the fp32 master where there is one (its owned part
        under ZeRO-1)."""
        start, n = self._where[path]
        delta = delta.reshape(-1).to(self.weights.device)
        if self.gathered is None:
            self.weights[start : start + n] += delta.to(self.weights.dtype)
        for a, b, at in self.owned_pieces(start, n):
            piece = delta[a - start : b - start]
            if self.gathered is not None:
                self.weights[at : at + b - a] += piece.to(self.weights.dtype)
            if self.main is not None:
                self.main[at : at + b - a] += piece

    def matrix_states(self) -> dict[str, Any]:
        """The matrix optimizer's states of the leaves computed here ({stage.path: (state, mesh
        axes of the ranks holding it alike)}; SOAP's), which checkpoints save."""
        return self._matrices.held_states()

    def main_grads(self) -> list[torch.Tensor]:
        """The owned fp32 gradient pieces of the state (a whole fp32 gradient's chunks; one piece
        otherwise; ExpertSplitState has more)."""
        grad = self.main_grad()
        return grad.chunks if isinstance(grad, OwnedView) else [grad]
