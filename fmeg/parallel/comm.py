"""Communicators: the few out-of-place collectives fmeg needs, over one group of ranks.

A Group has `size`, `rank` (index inside the group) and returns new tensors, never mutating its
input:

    all_reduce(x, op)                 sum ("sum") or maximum ("max") over the group
    all_gather(x, dim)                concatenation of every rank's x along dim, in rank order
    reduce_scatter(x, dim)            this rank's chunk (along dim) of the sum over the group
    all_to_all(x, split_dim, cat_dim) chunk j of rank i's x goes to rank j, concatenated along
        cat_dim
    all_to_all_rows(x, send, recv)
        uneven: rank i's next send[j] rows go to rank j; recv[j] rows arrive
                                      from rank j (the counts every pair agrees on), in rank order
    send(x, dst, tag) / recv(src, tag) point to point (pipelines): sends are buffered (the sender
        goes on
                                      at once, finish() waits for them), receives block; messages
                                          with one
                                      (source, destination, tag) arrive in the order they were sent

Asynchronous calls, for gradient buckets and gathered weights, work in place on a buffer the
caller owns and must leave alone until the returned handle's wait() has returned:

    all_reduce_async(x)               x becomes the sum over the group
    reduce_async(x, dst)              on group rank dst, x becomes the sum; elsewhere x is scratch
    broadcast_async(x, src)           x becomes group rank src's x
    all_gather_into_async(out, x)     out (size * x.numel() elements) becomes each rank's x in rank
                                      order (x may be this rank's part of out)
    reduce_scatter_async(out, x)      out becomes this rank's 1/size of the sum of x

Implementations: TorchGroup (a torch.distributed process group: gloo or NCCL), ThreadGroup (ranks as
threads of one process, for tests and notebooks) and RecordingGroup (counts bytes, wraps either).
These calls are not differentiable; fmeg.parallel.collectives wraps them with autograd rules.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed the flat collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single): the old names warn on every call
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_INTO = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
# dtype code, ndim, up to 7 sizes
_HEADER = 9


class TorchGroup:
    """A torch.distributed process group seen from one of its members. device: where point-to-point
    headers and received tensors are allocated (a CUDA device for NCCL, which moves only CUDA
    tensors). Under torch.compile the four collectives are functional collectives, which dynamo
    traces into the graph."""

    def __init__(self, process_group: Any, rank: int, device: Any = "cpu"):
        self.pg, self.rank, self.size = process_group, rank, dist.get_world_size(process_group)
        self.device = torch.device(device)
        self.gloo = dist.get_backend(process_group) == "gloo"

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, op, self.pg)
        y = x.contiguous().clone()
        dist.all_reduce(y, op=_OPS[op], group=self.pg)
        return y

    def all_reduce_async(self, x: torch.Tensor) -> Any:
        return dist.all_reduce(x, group=self.pg, async_op=True)

    def reduce_async(self, x: torch.Tensor, dst: int) -> Any:
        return dist.reduce(x, group=self.pg, group_dst=dst, async_op=True)

    def broadcast_async(self, x: torch.Tensor, src: int) -> Any:
        return dist.broadcast(x, group=self.pg, group_src=src, async_op=True)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(x.contiguous(), dim, self.pg)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.pg)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        # gloo's reduce_scatter_tensor, called inside torch.func's transforms (sequence
        # parallelism's backward), mutates a tensor the transform does not own: reduce, keep ours
        if self.gloo:
            return self.all_reduce(x).chunk(self.size, dim=dim)[self.rank].contiguous()
        if torch.compiler.is_compiling():
            return funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, self.pg)
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.pg)
        return out

    def all_gather_into_async(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        return _ALL_GATHER_INTO(out, x, group=self.pg, async_op=True)

    def reduce_scatter_async(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        return _REDUCE_SCATTER_INTO(out, x, group=self.pg, async_op=True)

    def all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int) -> torch.Tensor:
        # chunks stacked on a new leading dim travel as one tensor
        if torch.compiler.is_compiling():
            stacked = torch.stack(x.chunk(self.size, dim=split_dim)).contiguous()
            received = funcol.all_to_all_single(stacked, None, None, self.pg)
            return torch.cat(received.unbind(0), dim=cat_dim)
        inputs = [c.contiguous() for c in x.chunk(self.size, dim=split_dim)]
        outputs = [torch.empty_like(c) for c in inputs]
        dist.all_to_all(outputs, inputs, group=self.pg)
        return torch.cat(outputs, dim=cat_dim)

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.pg
        )
        return out

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Buffered: a header (dtype, shape) then the data, both isend; finish() waits for them."""
        if x.dim() > _HEADER - 2:
            raise ValueError(f"send: at most {_HEADER - 2} dimensions, got {x.dim()}")
        header = torch.tensor(
            [_DTYPES.index(x.dtype), x.dim(), *x.shape] + [0] * (_HEADER - 2 - x.dim()),
            dtype=torch.int64,
            device=self.device,
        )
        data = x.detach().contiguous().clone()
        self._pending = getattr(self, "_pending", [])
        for t in (header, data):
            self._pending.append((dist.isend(t, group=self.pg, group_dst=dst, tag=tag), t))

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.pg, group_src=src, tag=tag)
        code, ndim, *sizes = header.tolist()
        out = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(out, group=self.pg, group_src=src, tag=tag)
        return out

    def finish(self) -> None:
        """Wait for every buffered send to complete."""
        for work, _ in getattr(self, "_pending", []):
            work.wait()
        self._pending = []


class _Rendezvous:
    def __init__(self, size: int, timeout: float):
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.timeout = timeout
        self.mailboxes: dict[tuple[int, int, int], "queue.Queue[torch.Tensor]"] = {}
        self.lock = threading.Lock()

    def mailbox(self, src: int, dst: int, tag: int) -> "queue.Queue[torch.Tensor]":
        with self.lock:
            return self.mailboxes.setdefault((src, dst, tag), queue.Queue())


class ThreadWorld:
    """Shared state for ranks that are threads of one process; one per simulated world."""

    def __init__(self, world_size: int, timeout: float = 60.0):
        self.world_size, self.timeout = world_size, timeout
        self._rendezvous: dict[tuple[int, ...], _Rendezvous] = {}
        self._lock = threading.Lock()

    def group(self, ranks: list[int], rank: int) -> "ThreadGroup | None":
        if rank not in ranks:
            return None
        with self._lock:
            rv = self._rendezvous.setdefault(tuple(ranks), _Rendezvous(len(ranks), self.timeout))
        return ThreadGroup(rv, ranks.index(rank), len(ranks))

    def abort(self) -> None:
        """Wake every waiting rank with an error (one rank failed; the others must not hang)."""
        with self._lock:
            for rv in self._rendezvous.values():
                rv.barrier.abort()


class ThreadGroup:
    """A group whose members are threads: each call exchanges tensors through shared slots."""

    def __init__(self, rendezvous: _Rendezvous, rank: int, size: int):
        self._rv, self.rank, self.size = rendezvous, rank, size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order: this rank's own x, the others' as plain data (see
        _shareable)."""
        self._rv.slots[self.rank] = _shareable(x)
        self._rv.barrier.wait()
        # copies, taken while every peer waits: once past the barrier a peer may change its
        # tensor in place (zero a gradient buffer, copy a result in), as after a real collective
        with torch._C._DisableFuncTorch():
            peers = [peer.clone() for peer in self._rv.slots]
        # nobody overwrites a slot before all have read
        self._rv.barrier.wait()
        peers[self.rank] = x
        return peers

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        parts = self._exchange(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if op == "sum" else torch.maximum(out, p)
        return out

    def all_reduce_async(self, x: torch.Tensor) -> "_Done":
        # a clone: other ranks may still be reading the slot
        x.copy_(self.all_reduce(x.clone()))
        return _Done()

    def reduce_async(self, x: torch.Tensor, dst: int) -> "_Done":
        total = self.all_reduce(x.clone())
        if self.rank == dst:
            x.copy_(total)
        return _Done()

    def broadcast_async(self, x: torch.Tensor, src: int) -> "_Done":
        value = self._exchange(x.clone())[src]
        if self.rank != src:
            x.copy_(value)
        return _Done()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.all_reduce(x).chunk(self.size, dim=dim)[self.rank].contiguous()

    def all_gather_into_async(self, out: torch.Tensor, x: torch.Tensor) -> "_Done":
        # a clone: x may be a view of out
        out.copy_(self.all_gather(x.clone(), 0))
        return _Done()

    def reduce_scatter_async(self, out: torch.Tensor, x: torch.Tensor) -> "_Done":
        out.copy_(self.reduce_scatter(x.clone(), 0))
        return _Done()

    def all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int) -> torch.Tensor:
        parts = self._exchange(x)
        return torch.cat([p.chunk(self.size, dim=split_dim)[self.rank] for p in parts], dim=cat_dim)

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        parts = self._exchange(x)
        splits = self._exchange(torch.tensor(send))
        out = torch.cat([p.split(c.tolist())[self.rank] for p, c in zip(parts, splits)])
        if out.shape[0] != sum(recv):
            raise ValueError(
                f"rank {self.rank}: expected {sum(recv)} rows, peers sent {out.shape[0]}"
            )
        return out

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._rv.mailbox(self.rank, dst, tag).put(_shareable(x).clone())

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        try:
            return self._rv.mailbox(src, self.rank, tag).get(timeout=self._rv.timeout)
        except queue.Empty:
            raise TimeoutError(
                f"rank {self.rank}: nothing from rank {src} (tag {tag}) within {self._rv.timeout} s"
            ) from None

    def finish(self) -> None:
        """Sends are delivered when made; nothing to wait for."""


def _shareable(x: torch.Tensor) -> torch.Tensor:
    """x's data without torch.func's gradient-tracking wrappers, safe for another thread to read.

    In a backward pass under torch.func.grad the gradient reaching a collective is wrapped at the
    calling thread's transform level. Levels are per thread: a peer that computes with the wrapper
    after its owner has left torch.func.grad fails ("bad optional access"), and its result would
    join the owner's graph. What a peer needs is the value, as torch.distributed would send it."""
    while torch._C._functorch.is_gradtrackingtensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    # inside a transform, detach() would wrap the result again
    with torch._C._DisableFuncTorch():
        return x.detach()


class _Done:
    """The handle of a collective that has already completed (threads run them synchronously)."""

    def wait(self) -> bool:
        return True


@dataclass
class RecordingGroup:
    """Wraps a group and records (operation, bytes) per call: the logical volume, i.e. the size of
    the full (unsharded) tensor an all-reduce, all-gather or reduce-scatter works on."""

    inner: Any
    log: list[tuple[str, int]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.log.append(("all_reduce", x.numel() * x.element_size()))
        return self.inner.all_reduce(x, op)

    def all_reduce_async(self, x: torch.Tensor) -> Any:
        self.log.append(("all_reduce", x.numel() * x.element_size()))
        return self.inner.all_reduce_async(x)

    def reduce_async(self, x: torch.Tensor, dst: int) -> Any:
        self.log.append(("reduce", x.numel() * x.element_size()))
        return self.inner.reduce_async(x, dst)

    def broadcast_async(self, x: torch.Tensor, src: int) -> Any:
        self.log.append(("broadcast", x.numel() * x.element_size()))
        return self.inner.broadcast_async(x, src)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.log.append(("all_gather", x.numel() * x.element_size() * self.size))
        return self.inner.all_gather(x, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.log.append(("reduce_scatter", x.numel() * x.element_size()))
        return self.inner.reduce_scatter(x, dim)

    def all_gather_into_async(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        self.log.append(("all_gather", out.numel() * out.element_size()))
        return self.inner.all_gather_into_async(out, x)

    def reduce_scatter_async(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        self.log.append(("reduce_scatter", x.numel() * x.element_size()))
        return self.inner.reduce_scatter_async(out, x)

    def all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int) -> torch.Tensor:
        self.log.append(("all_to_all", x.numel() * x.element_size()))
        return self.inner.all_to_all(x, split_dim, cat_dim)

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self.log.append(("all_to_all", x.numel() * x.element_size()))
        return self.inner.all_to_all_rows(x, send, recv)
