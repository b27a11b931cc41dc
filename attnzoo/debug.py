"""Debug views of the Triton kernels: how many tiles each program visited and skipped.

>>> counts = attnzoo.debug.tile_counts("triton_2kernel", q, k, v, causal=True, seqlens_k=seqlens)
>>> counts.visited        # int32 [B, H, num_q_blocks]: K/V tiles each forward program loaded
>>> counts.skipped        # the K/V tiles it never loaded (causal limit, window or seqlens_k: block early exit)

The numbers are counted by the kernels themselves (a ``DEBUG`` constexpr adds a counter to each loop and
writes it to a buffer), with a fixed block size so that they can be compared with the exact geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._env import triton_interpreter_active
from .backend import Backend, get
from .validation import validate_forward

KERNELS = {
    "triton_2kernel": ("forward", "dkdv", "dq"),
    "triton_atomic": ("forward", "atomic"),
}


@dataclass(frozen=True)
class TileCounts:
    """Per-program tile counts of one kernel.

    ``kernel`` "forward", "dq" or "atomic" (Q-stationary): ``visited``/``skipped`` are ``[B, H, cdiv(Nq, block_m)]``
    counts of K/V tiles.  ``kernel`` "dkdv" (K/V-stationary): ``[B, Hkv, cdiv(Nk, block_n)]`` counts of Q tiles,
    summed over the query heads of the group.
    """

    kernel: str
    visited: torch.Tensor
    skipped: torch.Tensor
    block_m: int
    block_n: int


def _default_blocks() -> tuple[int, int]:
    return (16, 16) if triton_interpreter_active() else (64, 64)


def tile_counts(
    backend: str | Backend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    seqlens_k: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: str = "forward",
    window: tuple[int | None, int | None] | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> TileCounts:
    """Run one kernel of a Triton backend in debug mode and return its per-program visited/skipped tile counts.

    backend: "triton_2kernel" or "triton_atomic" (or an instance, e.g. ``attnzoo.get("triton_atomic",
    delta="recompute")``).  kernel: "forward"; "dkdv" or "dq" (triton_2kernel); "atomic" (triton_atomic).  Backward
    kernels run on the forward's own ``o``/``lse`` and a random ``do`` (counts do not depend on values).
    block_m, block_n: tile sizes (default 16 x 16 under the interpreter, 64 x 64 on the GPU).
    window: SPEC.md's ``(left, right)``; the tiles wholly outside it count as skipped (never loaded).
    """
    backend = get(backend) if isinstance(backend, str) else backend
    if backend.name not in KERNELS:
        raise ValueError(f"tile counts exist for {', '.join(KERNELS)}, not {backend.name!r}")
    if kernel not in KERNELS[backend.name]:
        raise ValueError(f"kernel of {backend.name} must be one of {KERNELS[backend.name]}, got {kernel!r}")
    default_m, default_n = _default_blocks()
    block_m, block_n = block_m or default_m, block_n or default_n
    reasons = backend.not_supported_reasons(q, k, v, causal=causal, scale=scale, seqlens_k=seqlens_k, window=window)
    if reasons:
        raise NotImplementedError(f"backend {backend.name!r} does not support this input: " + "; ".join(reasons))
    problem = validate_forward(q, k, v, causal, scale, seqlens_k, window)
    config = f"{block_m}x{block_n} w4 s2"
    options = {name: value for name, value in backend.options().items() if name != "configs"}
    fixed = get(backend.name, **options, configs=dict.fromkeys(KERNELS[backend.name], config))
    counts = fixed.counted_run(q, k, v, problem, backward=kernel != "forward")[kernel].cpu()
    B, H, Nq = q.shape[:3]
    Hkv, Nk = k.shape[1], k.shape[2]
    if kernel == "dkdv":
        shape = (B, Hkv, -(-Nk // block_n))
    else:
        shape = (B, H, -(-Nq // block_m))
    counts = counts.view(*shape, 2)
    return TileCounts(kernel, counts[..., 0], counts[..., 1], block_m, block_n)
