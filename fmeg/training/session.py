"""The runner's process-level state: this rank's device, its process groups
(fmeg.parallel.mesh.Mesh) and the few host-side agreements every rank must make (stop together,
share a token, wait for each other).

    # after validation: the only place a process group is created
    session = Session.start(cfg)
    ...
    session.close()
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fmeg.parallel.mesh import Mesh


def choose_device(requested: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK (NCCL) when asked for or, with auto, when CUDA is available; else the CPU
    (gloo)."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def first_problem(problem: str, device: torch.device) -> str:
    """The lowest-numbered rank's problem ('' when no rank has one), the same on every rank: a
    problem one rank alone found (a damaged part of a checkpoint that only it reads) ends every rank
    with the same line."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor([rank if problem else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    source = int(first.item())
    if source == world:
        return ""
    data = torch.zeros(2048, dtype=torch.uint8, device=device)
    if rank == source:
        encoded = problem.encode()[:2048]
        data[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(data, src=source)
    return bytes(data.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def silent_ranks(wait: float = 5.0) -> list[int]:
    """After a collective timed out on this rank: the ranks that do not answer a roll call through
    the rendezvous store within `wait` seconds (stopped or hung; torchrun's agent holds the store,
    so it outlives any rank). Every rank that timed out calls it; [] when the store cannot be
    reached."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        # the default store is this restart's own (_restart_safe_store)
        prefix = "fmeg/roll_call/"
        store.set(f"{prefix}{rank}", "here")
        deadline = time.monotonic() + wait
        while True:
            here = [r for r in range(world) if store.check([f"{prefix}{r}"])]
            if len(here) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in here]
            time.sleep(0.2)
    except (RuntimeError, ValueError):
        return []


def _restart_safe_store(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """init_process_group's store under torchrun's agent: the agent's own (it outlives any rank,
    which silent_ranks needs) under a prefix of its own for every restart of the workers. torch
    joins it unprefixed, so a restarted group would read the dead group's addresses and fail to
    connect (pytorch/pytorch#135712). Elsewhere (no agent store): {}, torch's env:// as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"/fmeg/restart_{restart}/", agent),
        "rank": rank,
        "world_size": world,
    }


@dataclass
class Session:
    world: int
    rank: int
    device: torch.device
    mesh: Mesh
    # the torch.compile backend of the step's stages, None for eager
    compile: str | None
    # how many times torchrun restarted this job's workers (--max-restarts)
    restarts: int = 0

    @classmethod
    def start(cls, cfg) -> Session:
        world, rank = cfg.world, int(os.environ.get("RANK", "0"))
        device = choose_device(cfg.runtime.device, int(os.environ.get("LOCAL_RANK", "0")))
        compiled = device.type == "cuda" if cfg.runtime.compile is None else cfg.runtime.compile
        # --deterministic-mode's exact sums read host values: its stages run eagerly (a notice)
        compiled = compiled and not cfg.training.deterministic
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif cfg.training.deterministic:
            # a CPU kernel splits its reductions by the thread count, which a one-process run and
            # torchrun's workers (one thread each) set differently
            torch.set_num_threads(1)
        if world > 1:
            timeout = datetime.timedelta(minutes=cfg.runtime.distributed_timeout_minutes)
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
                **_restart_safe_store(rank, world, timeout),
            )
            mesh = Mesh.from_torch_distributed(
                tp=cfg.layout.tp,
                pp=cfg.layout.pp,
                cp=cfg.layout.cp,
                ep=cfg.layout.ep,
                etp=cfg.layout.expert_tp,
                cp_a2a=cfg.layout.cp_a2a,
                dp_outer=cfg.layout.dp_outer,
                device=device,
                timeout=timeout,
            )
        else:
            mesh = Mesh.single()
        return cls(
            world,
            rank,
            device,
            mesh,
            "inductor" if compiled else None,
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    @property
    def last_rank(self) -> bool:
        """The rank that holds the loss and prints (the last pipeline stage's last rank)."""
        return self.rank == self.world - 1

    def any_rank(self, flag: bool) -> bool:
        """Whether any rank's flag is set (one all-reduce)."""
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def first_failure(self, failed: bool, size: int) -> tuple[int, int]:
        """(the lowest rank that failed, or world when none did; the sum of every rank's size), in
        place of a barrier."""
        status = torch.tensor(
            [self.rank if failed else self.world, size], dtype=torch.int64, device=self.device
        )
        if self.world > 1:
            first = status[:1].clone()
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            dist.all_reduce(status[1:], op=dist.ReduceOp.SUM)
            status[0] = first[0]
        return int(status[0]), int(status[1])

    def first_problem(self, problem: str) -> str:
        return first_problem(problem, self.device)

    def every_rank(self, value: int) -> list[int]:
        """Each rank's value, in rank order, on every rank (one all-gather)."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        if self.world == 1:
            return [value]
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [int(t.item()) for t in out]

    def shared_token(self, value: int) -> int:
        """Rank 0's value on every rank."""
        token = torch.tensor(
            [value if self.rank == 0 else 0], dtype=torch.int64, device=self.device
        )
        if self.world > 1:
            dist.broadcast(token, src=0)
        return int(token.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()

    def to_device(self, values):
        from fmeg import tree

        return tree.tree_map(lambda t: t.to(self.device), values)
