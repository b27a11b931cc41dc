"""``attnzoo.attention``: an autograd drop-in for ``torch.nn.functional.scaled_dot_product_attention``."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backend import Backend, get, names
from .validation import Problem, validate_forward

Tensor = torch.Tensor


def pick_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Backend:
    """The preferred backend (lowest ``auto_rank`` on the device type) that supports these inputs."""
    return _pick(validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes))


def _pick(problem: Problem) -> Backend:
    candidates = []
    for name in names():
        backend = get(name)
        rank = backend.capabilities.auto_rank.get(problem.device)
        if rank is not None and not backend.reasons_for(problem):
            candidates.append((rank, name))
    if not candidates:
        raise NotImplementedError(
            "no registered backend supports these inputs: "
            + "; ".join(f"{n}: {', '.join(get(n).reasons_for(problem))}" for n in names())
        )
    return get(min(candidates)[1])


class _Attention(torch.autograd.Function):
    # seqlens_k and alibi_slopes travel inside ``problem``, not as inputs of the Function: they get no gradient.
    @staticmethod
    def forward(ctx, q, k, v, backend, problem):
        o, lse = backend.forward_validated(q, k, v, problem)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.backend, ctx.problem = backend, problem
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward_validated(do, q, k, v, o, lse, ctx.problem)
        return dq, dk, dv, None, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    backend: str | Backend = "auto",
) -> Tensor:
    """Exact attention with autograd, like ``scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    q: ``[B, H, Nq, D]``; k: ``[B, Hkv, Nk, D]``, v: ``[B, Hkv, Nk, Dv]`` with ``H % Hkv == 0``; seqlens_k: integer
    ``[B]`` or None; window, softcap, alibi_slopes: SPEC.md's score modifiers (the slopes get no gradient).
    Returns o: ``[B, H, Nq, Dv]`` in the dtype of q.  ``causal`` is aligned to the bottom-right corner.
    ``backend`` is a registered name, a :class:`Backend`, or ``"auto"``.
    """
    if not isinstance(backend, (str, Backend)):
        raise TypeError(f"backend must be a backend name, a Backend or 'auto', got {type(backend).__name__}")
    # torch tensors only, before any kernel
    problem = validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes)
    if isinstance(backend, str):
        backend = _pick(problem) if backend == "auto" else get(backend)
    return _Attention.apply(q, k, v, backend, problem)
