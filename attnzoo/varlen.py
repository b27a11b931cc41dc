"""``attnzoo.attention_varlen``: packed variable-length batches (flash-attn's varlen layout), with autograd.

Sequence ``b`` of the batch is the query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q ``[total_q, H, D]`` and
the key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k, v ``[total_k, Hkv, D or Dv]``; it is attention on its own
(SPEC.md, "Packed variable-length batches"): causal masks and windows align bottom-right within each sequence, ALiBi
counts positions within it, and no row sees a key of another sequence.  ``o`` is ``[total_q, H, Dv]`` and ``lse``
``[H, total_q]`` (each head's rows contiguous, as flash-attn's varlen lse).

Two custom operators carry the call, as :mod:`attnzoo.autograd` does for dense attention:

- ``attnzoo::attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
  scale, window_left, window_right, softcap, alibi_slopes, backend) -> (o, lse)``
- ``attnzoo::attention_varlen_backward(do, q, k, v, o, lse, <the same arguments>) -> (dq, dk, dv)``

Validation reads the values of ``cu_seqlens_*`` (one host synchronisation) in eager mode only: never while compiling
or capturing a CUDA graph, where the operators check shapes and dtypes alone.  ``max_seqlen_*`` are hints: eager mode
checks them against the real lengths (a hint below one is a ``ValueError``) and computes them when absent; traced,
an absent hint becomes ``total`` (a bound that needs no read).  No kernel depends on a hint for its answer: the
Triton kernels use them only to pick a launch config, and clamp windows by the totals.

A backend runs a packed call through ``Backend._forward_varlen`` / ``_backward_varlen``; by default that is one dense
call per sequence (:func:`forward_by_sequence`: a host loop over ``cu_seqlens``, the reference's way), and the
Triton backends override it with kernels that read the packed tensors directly.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from ._env import new_output
from .autograd import _backend_of, backend_key, default_scale
from .backend import Backend
from .validation import Problem, _validate_alibi_slopes, _validate_window, lse_dtype, validate_forward

Tensor = torch.Tensor


# -- validation ---------------------------------------------------------------------------------------------------
def _check_cu_seqlens(name: str, cu: Any, q: Tensor) -> None:
    """int32, 1-d ``[B + 1]`` with ``B >= 0``, dense, on the device of q (values are checked apart)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor [B + 1], got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.layout != torch.strided:
        raise TypeError(f"{name} must be a dense int32 tensor [B + 1], got {cu.dtype} ({cu.layout})")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-d [B + 1] with B >= 0, got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")


def _check_hint(name: str, hint: Any) -> None:
    if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 0):
        raise TypeError(f"{name} must be None or a non-negative int, got {type(hint).__name__} {hint!r}")


def _check_offsets(name: str, offsets: list[int], total: int, total_name: str) -> int:
    """SPEC.md's rules for one ``cu_seqlens`` read to the host; returns the longest sequence."""
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {offsets[0]}")
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{index}] = {offsets[index]} > "
                f"{name}[{index + 1}] = {offsets[index + 1]}"
            )
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at {total_name} = {total}, got {name}[-1] = {offsets[-1]}")
    return max(lengths, default=0)


def validate_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any = None,
    max_seqlen_k: Any = None,
    causal: Any = False,
    scale: Any = None,
    window: Any = None,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    *,
    check_values: bool = True,
) -> Problem:
    """Check the arguments of :func:`attention_varlen` and return the problem they describe (``is_varlen``).

    The problem's ``batch`` is ``B``, ``seqlen_q``/``seqlen_k`` the longest sequence's lengths (the hints when given
    and consistent; ``total_q``/``total_k`` when absent and ``check_values`` is off), the window clamped by
    ``total_q + total_k`` (which changes no sequence's mask).  ``check_values=False`` reads no tensor value (no host
    synchronisation): the operators' checks inside compiled graphs.  ``TypeError``/``ValueError`` name the argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            layout = "[total_q, H, D]" if name == "q" else "[total_k, Hkv, D]"
            raise ValueError(f"{name} must have rank 3, {layout}, got rank {x.dim()} with shape {tuple(x.shape)}")
    if tuple(k.shape[:2]) != tuple(v.shape[:2]):
        raise ValueError(
            f"k and v must have the same [total_k, Hkv] (v may have its own head dim), got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same batch: B + 1 = {cu_seqlens_q.shape[0]} "
            f"(cu_seqlens_q) and {cu_seqlens_k.shape[0]} (cu_seqlens_k)"
        )
    _check_hint("max_seqlen_q", max_seqlen_q)
    _check_hint("max_seqlen_k", max_seqlen_k)
    batch = int(cu_seqlens_q.shape[0]) - 1
    total_q, total_k = int(q.shape[0]), int(k.shape[0])
    # Everything but the sequence structure is dense attention's: each packed tensor seen as one sequence
    # [1, H, total, D] (the window is clamped by the totals there).  The slopes are checked against B below.
    dense = validate_forward(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        causal, scale, None, window, softcap, None,
    )  # fmt: skip
    if alibi_slopes is not None:
        _validate_alibi_slopes(alibi_slopes, batch, dense.heads, q, False)
    if check_values:
        offsets = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()  # one read of both
        longest_q = _check_offsets("cu_seqlens_q", offsets[: batch + 1], total_q, "total_q (q.shape[0])")
        longest_k = _check_offsets("cu_seqlens_k", offsets[batch + 1 :], total_k, "total_k (k.shape[0])")
        hints = (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k))
        for name, hint, longest in hints:
            if hint is not None and hint < longest:
                raise ValueError(f"{name} = {hint} is below the longest sequence's length {longest}")
        max_seqlen_q = longest_q if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = longest_k if max_seqlen_k is None else max_seqlen_k
    max_seqlen_q = total_q if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = total_k if max_seqlen_k is None else max_seqlen_k
    return dataclasses.replace(
        dense,
        batch=batch,
        seqlen_q=int(max_seqlen_q),
        seqlen_k=int(max_seqlen_k),
        alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )


# -- the reference way: one dense call per sequence -----------------------------------------------------------------
def sequence_bounds(problem: Problem) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, k_start, k_end)`` of every sequence (reads ``cu_seqlens_*`` to the host)."""
    offsets_q = problem.cu_seqlens_q.tolist()
    offsets_k = problem.cu_seqlens_k.tolist()
    return [
        (offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]) for b in range(problem.batch)
    ]  # fmt: skip


def as_sequence(x: Tensor) -> Tensor:
    """Packed rows ``[n, heads, d]`` as one dense sequence ``[1, heads, n, d]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def sequence_problem(problem: Problem, b: int, seqlen_q: int, seqlen_k: int) -> Problem:
    """The dense problem of sequence ``b`` alone: batch 1, its lengths, its ALiBi slopes, its clamped window."""
    slopes = problem.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[b : b + 1]
    return dataclasses.replace(
        problem,
        batch=1,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        window=_validate_window(problem.window, seqlen_q, seqlen_k),
        alibi_slopes=slopes,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
    )


def forward_by_sequence(backend: Backend, q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> tuple[Tensor, Tensor]:
    """``backend``'s dense forward on each sequence in turn -> packed ``o`` ``[total_q, H, Dv]``, ``lse``
    ``[H, total_q]``."""
    o = new_output((q.shape[0], problem.heads, problem.head_dim_v), q.dtype, q.device)
    lse = new_output((problem.heads, q.shape[0]), lse_dtype(problem.dtype), q.device)
    for b, (q0, q1, k0, k1) in enumerate(sequence_bounds(problem)):
        if q1 == q0:
            continue
        sub = sequence_problem(problem, b, q1 - q0, k1 - k0)
        o_b, lse_b = backend.forward_validated(as_sequence(q[q0:q1]), as_sequence(k[k0:k1]), as_sequence(v[k0:k1]), sub)
        o[q0:q1] = o_b[0].transpose(0, 1)
        lse[:, q0:q1] = lse_b[0]
    return o, lse


def backward_by_sequence(
    backend: Backend, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, problem: Problem
) -> tuple[Tensor, Tensor, Tensor]:
    """``backend``'s dense backward on each sequence in turn -> packed ``dq``, ``dk``, ``dv`` (keys of a sequence
    without query rows get zero gradients)."""
    dq = new_output(q.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    for b, (q0, q1, k0, k1) in enumerate(sequence_bounds(problem)):
        sub = sequence_problem(problem, b, q1 - q0, k1 - k0)
        dq_b, dk_b, dv_b = backend.backward_validated(
            as_sequence(do[q0:q1]), as_sequence(q[q0:q1]), as_sequence(k[k0:k1]), as_sequence(v[k0:k1]),
            as_sequence(o[q0:q1]), lse[:, q0:q1].unsqueeze(0), sub,
        )  # fmt: skip
        dq[q0:q1] = dq_b[0].transpose(0, 1)
        dk[k0:k1] = dk_b[0].transpose(0, 1)
        dv[k0:k1] = dv_b[0].transpose(0, 1)
    return dq, dk, dv


# -- running a backend on a validated packed call --------------------------------------------------------------------
def validate_varlen_backward(problem: Problem, q: Tensor, do: Tensor, o: Tensor, lse: Tensor) -> None:
    """``do``/``o`` ``[total_q, H, Dv]`` in q's dtype and device, ``lse`` ``[H, total_q]`` as the forward made it."""
    expected = (q.shape[0], problem.heads, problem.head_dim_v)
    for name, x in (("do", do), ("o", o)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} must have shape [total_q, H, Dv] = {list(expected)}, got {list(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {x.dtype}, {x.device}")
    if not isinstance(lse, Tensor) or tuple(lse.shape) != (problem.heads, q.shape[0]):
        shape = tuple(lse.shape) if isinstance(lse, Tensor) else type(lse).__name__
        raise ValueError(f"lse must have shape [H, total_q] = {[problem.heads, q.shape[0]]}, got {shape}")
    if lse.dtype != lse_dtype(problem.dtype) or lse.device != q.device:
        raise TypeError(f"lse must be {lse_dtype(problem.dtype)} on {q.device}, got {lse.dtype} on {lse.device}")


def run_varlen_forward(backend: Backend, q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> tuple[Tensor, Tensor]:
    """``backend``'s packed forward on a validated call (refused with ``NotImplementedError`` when unsupported)."""
    return backend.forward_varlen_validated(q, k, v, problem)


def run_varlen_backward(
    backend: Backend, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, problem: Problem
) -> tuple[Tensor, Tensor, Tensor]:
    """``backend``'s packed backward on a validated call -> ``dq``, ``dk``, ``dv``."""
    validate_varlen_backward(problem, q, do, o, lse)
    return backend.backward_varlen_validated(do, q, k, v, o, lse, problem)


# -- the operators --------------------------------------------------------------------------------------------------
def _op_problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, slopes) -> Problem:
    window = None if left is None and right is None else (left, right)
    return validate_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, slopes, check_values=False
    )  # fmt: skip


@torch.library.custom_op("attnzoo::attention_varlen_forward", mutates_args=())
def attention_varlen_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``o`` ``[total_q, H, Dv]`` (dtype of q) and ``lse`` ``[H, total_q]`` (float32; float64 for float64)."""
    problem = _op_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
        softcap, alibi_slopes,
    )  # fmt: skip
    return run_varlen_forward(_backend_of(backend, problem), q, k, v, problem)


@attention_varlen_forward_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, slopes, backend):
    total_q, heads = q.shape[0], q.shape[1]
    return q.new_empty((total_q, heads, v.shape[-1])), q.new_empty((heads, total_q), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("attnzoo::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq``, ``dk``, ``dv`` with the shapes of q, k, v (dk, dv summed over each query-head group)."""
    problem = _op_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
        softcap, alibi_slopes,
    )  # fmt: skip
    return run_varlen_backward(_backend_of(backend, problem), do, q, k, v, o, lse, problem)


@attention_varlen_backward_op.register_fake
def _(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, slopes, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, slopes, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, slopes)
    ctx.arguments = (max_q, max_k, causal, scale, left, right, softcap)
    ctx.backend = backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k, slopes = ctx.saved_tensors
    max_q, max_k, causal, scale, left, right, softcap = ctx.arguments
    dq, dk, dv = attention_varlen_backward_op(
        do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, slopes, ctx.backend
    )
    # cu_seqlens, the hints, the slopes and the flags get no gradient.
    return dq, dk, dv, *([None] * 11)


attention_varlen_forward_op.register_autograd(_backward, setup_context=_setup_context)


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    backend: str | Backend = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a packed batch of variable-length sequences, with autograd (SPEC.md).

    q: ``[total_q, H, D]``; k: ``[total_k, Hkv, D]``, v: ``[total_k, Hkv, Dv]`` (``H % Hkv == 0``); cu_seqlens_q,
    cu_seqlens_k: int32 ``[B + 1]``, starting at 0, non-decreasing, ending at total_q and total_k: sequence ``b`` is
    rows ``cu[b]:cu[b + 1]``.  max_seqlen_q/k: the longest sequence's lengths, or None (then computed in eager mode,
    one host synchronisation); a hint below a real length is a ``ValueError``.  ``causal``, ``window``, ``softcap``
    and ``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``) apply per sequence, aligned bottom-right within it.
    Returns ``o`` ``[total_q, H, Dv]`` (dtype of q), and with ``return_lse`` also ``lse`` ``[H, total_q]`` (float32;
    float64 for float64 inputs; no gradient flows through it).  Works inside ``torch.compile(fullgraph=True)``.
    """
    key = backend_key(backend)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not torch.compiler.is_compiling():
        capturing = isinstance(q, Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()
        problem = validate_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
            alibi_slopes, check_values=not capturing,
        )  # fmt: skip
        max_seqlen_q, max_seqlen_k = problem.seqlen_q, problem.seqlen_k
    else:
        max_seqlen_q = q.shape[0] if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = k.shape[0] if max_seqlen_k is None else max_seqlen_k
    left, right = (None, None) if window is None else window
    o, lse = attention_varlen_forward_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
        float(default_scale(q, scale)), left, right, float(softcap), alibi_slopes, key,
    )  # fmt: skip
    return (o, lse) if return_lse else o
