"""A run's layout: how the model and the batch are split over ranks (tp, pp with virtual stages, dp,
cp, ep and the experts' tp, sequence parallelism, recomputation, what data-parallel ranks keep a
slice of). The mesh (fmeg.parallel.mesh) holds the process groups of the same axes; the layout says
how they are used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fmeg.parallel.mesh import Mesh
from fmeg.parallel.pipeline.actions import Placement, looped, v_shape
from fmeg.parallel.pipeline.schedules import V_SCHEDULES


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    # virtual pipeline stages per rank
    chunks: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    # Megatron's (granularity, method, layers)
    recompute: tuple[str, str | None, int | None] | None = None
    # what selective recomputation recomputes
    recompute_modules: tuple[str, ...] = ("core_attn",)
    # what data-parallel ranks keep a slice of (fmeg.state.SHARDINGS); "optim": ZeRO-1
    sharding: str = "no_shard"
    micro_batch_size: int = 1
    # expert parallelism: each of ep data-parallel ranks holds num_experts / ep experts
    ep: int = 1
    # the experts' tensor parallelism (None: tp)
    etp: int | None = None
    # context parallelism: cp ranks split each sequence (fmeg.parallel.context); replicas otherwise
    cp: int = 1
    # one for every layer, or one per layer
    cp_comm_type: str | tuple[str, ...] = "p2p"
    # a2a+p2p: the a2a level's size (--hierarchical-context-parallel-sizes a2a p2p)
    cp_a2a: int = 1
    # hybrid sharding (Megatron's --num-distributed-optimizer-instances): the sliced state is
    # sharded over dp x cp / dp_outer ranks and replicated dp_outer times
    dp_outer: int = 1
    # the decoder layers of each of the pp * chunks stages in forward order (Megatron's uneven
    # layouts); None: every stage holds as many
    stage_layers: tuple[int, ...] | None = None

    @property
    def zero(self) -> bool:
        """Whether the optimizer state is sliced over data parallelism (the distributed optimizer,
        or more)."""
        return self.sharding != "no_shard"

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def experts_apart(self) -> bool:
        """Whether the experts are laid out apart from the dense leaves (expert parallelism, or
        their own tp)."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def cp_comm_types(self) -> tuple[str, ...]:
        return (self.cp_comm_type,) if isinstance(self.cp_comm_type, str) else self.cp_comm_type

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def placement(self) -> Placement:
        """The pipeline rank of each stage: a V (rank r holds stages r and 2 pp - 1 - r) under the
        V schedules, else Megatron's loop (stage s on rank s % pp)."""
        if self.schedule in V_SCHEDULES:
            return v_shape(self.pp)
        return looped(self.pp, self.chunks)

    def stages_on(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank pp_rank holds, in forward order."""
        return [s for s, r in enumerate(self.placement) if r == pp_rank]

    @property
    def loss_rank(self) -> int:
        """The pipeline rank of the last stage (which computes the loss)."""
        return self.placement[-1]

    @property
    def stages(self) -> int | tuple[int, ...]:
        """The stages as fmeg.models.gpt_pipeline takes them: their number when they are even, else
        each one's decoder layers."""
        return self.stage_layers if self.stage_layers is not None else self.num_stages

    def microbatches(self, global_batch: int) -> int:
        """Microbatches each data-parallel rank runs for a global batch."""
        return global_batch // (self.micro_batch_size * self.dp)

    def sizes(self) -> dict[str, int]:
        experts = (
            {
                "ep": self.ep,
                "etp": self.expert_tp,
                "edp": self.dp * self.tp * self.cp // (self.ep * self.expert_tp),
            }
            if self.experts_apart
            else {}
        )
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            **experts,
            **({"cp": self.cp} if self.cp > 1 else {}),
        }

    def coords(self, mesh: Mesh) -> dict[str, int]:
        """This rank's coordinates as checkpoints record them (its place in the experts' grid only
        when the experts are laid out apart)."""
        experts = (
            {"ep": mesh.coord("ep"), "etp": mesh.coord("expert_tp"), "edp": mesh.coord("expert_dp")}
            if self.experts_apart
            else {}
        )
        return {
            **{axis: mesh.coord(axis) for axis in ("tp", "pp", "dp")},
            **experts,
            **({"cp": mesh.coord("cp")} if self.cp > 1 else {}),
        }

    def checkpoint_meta(self, dtype: torch.dtype) -> dict:
        """The layout as checkpoints record it (fmeg.checkpoint.same_layout compares these)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "chunks": self.chunks,
            "dp": self.dp,
            "zero": self.zero,
            **({"sharding": self.sharding} if self.sharding not in ("no_shard", "optim") else {}),
            "dtype": str(dtype).removeprefix("torch."),
            **({"stage_layers": list(self.stage_layers)} if self.stage_layers else {}),
            **({"placement": "v"} if self.schedule in V_SCHEDULES else {}),
            **({"dp_outer": self.dp_outer} if self.dp_outer > 1 else {}),
            **({"ep": self.ep, "etp": self.expert_tp} if self.experts_apart else {}),
            **({"cp": self.cp} if self.cp > 1 else {}),
        }

    def describe(self) -> str:
        """As the start line says it: 'tp 2 x pp 2 (x1 virtual) x dp 1, sequence parallel'."""
        recompute = (
            " ".join(str(r) for r in self.recompute if r is not None) if self.recompute else ""
        )
        if (
            self.recompute
            and self.recompute[0] == "selective"
            and self.recompute_modules != ("core_attn",)
        ):
            recompute += f" ({' '.join(self.recompute_modules)})"
        return (
            f"tp {self.tp} x pp {self.pp} (x{self.chunks} virtual"
            + (", in a V" if self.schedule in V_SCHEDULES else "")
            + f") x dp {self.dp}"
            + (
                f" x cp {self.cp} ({' '.join(self.cp_comm_types)}"
                + (f", a2a {self.cp_a2a} x p2p {self.cp // self.cp_a2a}" if self.cp_a2a > 1 else "")
                + ")"
                if self.cp > 1
                else ""
            )
            + (f" (experts: ep {self.ep}, tp {self.expert_tp})" if self.experts_apart else "")
            + (
                f", layers per stage {'|'.join(map(str, self.stage_layers))}"
                if self.stage_layers
                else ""
            )
            + (", sequence parallel" if self.sequence_parallel else "")
            + (f", sharded {self.sharding}" if self.sharding not in ("no_shard", "optim") else "")
            + (
                f", hybrid: {self.dp_outer} replicas of the state sharded over "
                + (
                    f"{self.dp * self.cp // self.dp_outer} ranks"
                    if self.dp * self.cp > self.dp_outer
                    else "1 rank (whole)"
                )
                if self.dp_outer > 1
                else ""
            )
            + (f", recompute {recompute}" if recompute else "")
        )


def describe_saved(meta: object) -> str:
    """A layout as a checkpoint records it (Layout.checkpoint_meta), in the start line's words:
    'tp 2 x pp 1 (x1 virtual) x dp 2, distributed optimizer, bfloat16'. Keys a newer fmeg may add
    are named as they are."""
    if not isinstance(meta, dict):
        return "a layout the checkpoint does not record"
    rest = dict(meta)
    take = rest.pop
    words = f"tp {take('tp', 1)} x pp {take('pp', 1)} (x{take('chunks', 1)} virtual"
    words += (", in a V" if take("placement", None) == "v" else "") + f") x dp {take('dp', 1)}"
    cp = take("cp", 1)
    words += f" x cp {cp}" if cp > 1 else ""
    if "ep" in rest:
        words += f" (experts: ep {take('ep')}, tp {take('etp', meta.get('tp', 1))})"
    parts = [words]
    stages = take("stage_layers", None)
    if stages:
        parts.append(f"layers per stage {'|'.join(map(str, stages))}")
    sharding, zero = take("sharding", None), take("zero", False)
    if sharding:
        parts.append(f"sharded {sharding}")
    elif zero:
        parts.append("distributed optimizer")
    dp_outer = take("dp_outer", 1)
    if dp_outer > 1:
        parts.append(f"hybrid: {dp_outer} replicas of the state")
    dtype = take("dtype", None)
    parts += [f"{key} {value}" for key, value in rest.items()]
    if dtype:
        parts.append(str(dtype))
    return ", ".join(parts)
