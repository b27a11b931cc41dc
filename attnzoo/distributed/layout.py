"""Which part of the sequence each rank holds: the ``contiguous`` and ``zigzag`` layouts of dim 2.

``contiguous``: the sequence is cut into ``W`` equal chunks and rank ``r`` holds chunk ``r``.  ``zigzag``: it is cut
into ``2W`` chunks and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, in that order, one from each end.  Under a
causal mask the work of a (query chunk, key chunk) pair grows with the query chunk's position; pairing an early chunk
with a late one gives every rank the same amount of work at every ring step (``docs/design.md``, "Ring attention").

Everything here is index arithmetic on one process; :mod:`attnzoo.distributed.attention` does the communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in the order they lie in its local tensor."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def check_divisible(name: str, length: int, world: int, layout: str, *, local: bool) -> None:
    """A ``ValueError`` unless a sequence of ``length`` (this rank's part when ``local``) splits into equal chunks."""
    per_rank = chunks_per_rank(layout)
    if local:
        if length % per_rank:
            raise ValueError(
                f"{name} holds {length} rows in dim 2 on this rank; the {layout} layout needs a multiple of {per_rank} "
                f"(its {per_rank} chunks are equal)"
            )
    elif length % (per_rank * world):
        raise ValueError(
            f"{name} has {length} rows in dim 2; the {layout} layout over {world} ranks needs a multiple of "
            f"{per_rank * world} ({per_rank * world} equal chunks)"
        )


def take(x: Tensor, rank: int, world: int, layout: str) -> Tensor:
    """This rank's part of ``x`` along dim 2 (``x.shape[2]`` divisible by the layout's chunk count).  Differentiable:
    views and one concatenation."""
    size = x.shape[2] // (chunks_per_rank(layout) * world)
    parts = [x.narrow(2, chunk * size, size) for chunk in chunks_of(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def assemble(parts: Sequence[Tensor], layout: str) -> Tensor:
    """The whole tensor from every rank's part (``parts[r]`` is rank ``r``'s), chunks put back in sequence order."""
    world = len(parts)
    per_rank = chunks_per_rank(layout)
    size = parts[0].shape[2] // per_rank
    by_chunk: dict[int, Tensor] = {}
    for rank, part in enumerate(parts):
        for i, chunk in enumerate(chunks_of(rank, world, layout)):
            by_chunk[chunk] = part.narrow(2, i * size, size)
    return torch.cat([by_chunk[c] for c in range(per_rank * world)], dim=2)
