"""The ring's transport: ``torch.distributed`` point-to-point ops on a process group, one shift at a time (send to
the next rank, receive from the previous), started before the compute it overlaps and waited on after it.

A process group travels through the custom operators by its name (an operator's schema takes no objects); NCCL moves
CUDA tensors directly, and a group without a CUDA backend (gloo: several ranks sharing one GPU, or a machine without
NCCL) moves CUDA tensors through host copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

Tensor = torch.Tensor

# Tags keep the two streams of a backward step apart where the transport matches messages by tag (gloo).
TAG_KV, TAG_DKV = 1, 2


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a custom operator carries for ``group`` (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if group is None:
        group = c10d._get_default_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group.group_name


def resolve(name: str) -> dist.ProcessGroup:
    return c10d._resolve_process_group(name)


def moves_cuda_directly(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has a backend for CUDA tensors (NCCL); otherwise they are staged through the host."""
    return "nccl" in str(dist.get_backend(group)).lower()


class Ring:
    """This rank's place in ``group``: its rank, the world size and its neighbours (as global ranks, which
    ``P2POp`` takes)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.staged = not moves_cuda_directly(group)

    def shift(self, send: Tensor, recv: Tensor, tag: int) -> Transfer:
        """Start sending ``send`` to the next rank and receiving the previous rank's into ``recv`` (both contiguous,
        same shape and dtype); returns at once.  ``recv`` holds the data once :meth:`Transfer.wait` returns."""
        staged = self.staged and send.is_cuda
        send_buf = send.cpu() if staged else send
        recv_buf = torch.empty(recv.shape, dtype=recv.dtype) if staged else recv
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send_buf, self.next, self.group, tag),
                dist.P2POp(dist.irecv, recv_buf, self.prev, self.group, tag),
            ]
        )
        return Transfer(works, recv, recv_buf if staged else None)

    def all_gather(self, x: Tensor) -> list[Tensor]:
        """Every rank's ``x`` (same shape on all ranks), ``[r]`` being rank ``r``'s."""
        staged = self.staged and x.is_cuda
        local = (x.cpu() if staged else x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return [p.to(x.device) for p in parts] if staged else parts


class Transfer:
    """A started shift; :meth:`wait` blocks until both its send and its receive are done (on CUDA with NCCL: until the
    current stream is ordered after them)."""

    def __init__(self, works: list, recv: Tensor, staged_recv: Tensor | None):
        self.works, self.recv, self.staged_recv = works, recv, staged_recv

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        if self.staged_recv is not None:
            self.recv.copy_(self.staged_recv)
        return self.recv
