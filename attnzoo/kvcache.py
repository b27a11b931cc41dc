"""``attnzoo.attention_with_kvcache``: attention over a KV cache for inference, dense or paged, with in-place append.

The call (SPEC.md, "KV cache for inference") reaches the backends through one custom operator,
``attnzoo::attention_with_kvcache``, which declares that it writes ``k_cache`` and ``v_cache`` (``mutates_args``), so
that ``torch.compile`` orders it against other uses of the caches, and that has no autograd (inference only).  Inside
the operator, in this order:

1. the shapes are checked (the values of ``cache_seqlens`` and ``block_table`` only in eager mode, outside CUDA-graph
   capture: reading them is a host synchronisation);
2. ``k_new``/``v_new`` are written into the cache at positions ``cache_seqlens[b] ..`` (:func:`append_`), with index
   arithmetic on the GPU (no host sync, so that a decode step can be captured as a CUDA graph);
3. the backend attends to the first ``L_b = cache_seqlens[b] + Nnew`` keys of each sequence, with causal, the window
   and ALiBi aligned bottom-right to ``L_b`` (query row ``i`` sits at key position ``i + L_b - Nq``).

A paged cache is ``[num_pages, Hkv, page_size, D]`` with ``block_table[b, p]`` the physical page of logical page
``p`` of sequence ``b``: key ``t`` of sequence ``b`` is ``cache[block_table[b, t // page_size], :, t % page_size]``
(:func:`gather_sequence` writes exactly that).  A dense cache ``[B, Hkv, Ncache, D]`` holds key ``t`` of sequence
``b`` at ``cache[b, :, t]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from .autograd import _backend_of, backend_key, default_scale, pick_ranked
from .backend import Backend
from .validation import (
    FLOAT_DTYPES,
    Problem,
    _describe,
    _validate_alibi_slopes,
    _validate_softcap,
    _validate_window,
    lse_dtype,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class KVCacheProblem:
    """One validated KV-cache call.

    ``problem``: the attention call as the backends' support rules read it, with ``seqlen_k`` the cache's capacity
    (``Ncache``, or ``max_pages * page_size`` for a paged cache) and ``seqlens_k`` the ``cache_seqlens`` tensor.
    ``page_size``: 0 for a dense cache.  ``new_keys``: ``Nnew`` (0 without ``k_new``).
    """

    problem: Problem
    page_size: int
    new_keys: int
    num_pages: int

    @property
    def paged(self) -> bool:
        return self.page_size > 0


def _tensor(name: str, x: Any, rank: int, layout: str) -> Tensor:
    if not isinstance(x, Tensor) or x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense torch.Tensor {layout}, got {_describe(x)}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, {layout}, got rank {x.dim()} with shape {tuple(x.shape)}")
    return x


def validate_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    k_new: Any = None,
    v_new: Any = None,
    block_table: Any = None,
    causal: Any = True,
    scale: Any = None,
    window: Any = None,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    *,
    check_values: bool = True,
) -> KVCacheProblem:
    """Check every argument of :func:`attention_with_kvcache` before anything is written; ``TypeError`` for a wrong
    kind or dtype, ``ValueError`` for a wrong shape or value, each naming the argument, expected and actual.

    ``check_values=False`` leaves out the checks that read tensor values (``cache_seqlens + Nnew`` within the
    capacity, ``block_table`` entries within ``[0, num_pages)`` for the pages in use): they synchronise with the GPU.
    """
    q = _tensor("q", q, 4, "[B, H, Nq, D]")
    paged = block_table is not None
    cache_layout = "[num_pages, Hkv, page_size, D]" if paged else "[B, Hkv, Ncache, D]"
    k_cache = _tensor("k_cache", k_cache, 4, cache_layout)
    v_cache = _tensor("v_cache", v_cache, 4, cache_layout.replace(", D]", ", Dv]"))
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"q, k_cache and v_cache must have the same dtype, got q={q.dtype}, k_cache={k_cache.dtype}, "
            f"v_cache={v_cache.dtype}"
        )
    device = q.device
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != device:
            raise ValueError(f"{name} must be on the device of q ({device}), got {x.device}")
    B, H, Nq, D = q.shape
    slots, Hkv, page_or_len, Dk = k_cache.shape
    Dv = v_cache.shape[3]
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        what = "[num_pages, Hkv, page_size]" if paged else "[B, Hkv, Ncache]"
        raise ValueError(
            f"v_cache must have the {what} of k_cache (its own head dim allowed), got k_cache {tuple(k_cache.shape)} "
            f"and v_cache {tuple(v_cache.shape)}"
        )
    if Dk != D:
        raise ValueError(f"k_cache must have head dim {D} (as q), got {Dk}")
    if D < 1 or Dv < 1:
        raise ValueError(f"q and v_cache must have head dims >= 1, got D={D} and Dv={Dv}")
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of K/V heads, got H={H} (q) and "
            f"Hkv={Hkv} (k_cache, v_cache)"
        )
    if paged:
        block_table = _tensor("block_table", block_table, 2, "[B, max_pages]")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.device != device:
            raise ValueError(f"block_table must be on the device of q ({device}), got {block_table.device}")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape [B, max_pages] with B = {B}, got {tuple(block_table.shape)}")
        if page_or_len < 1:
            raise ValueError(f"k_cache must have page_size >= 1 (dim 2), got {page_or_len}")
        page_size, capacity, num_pages = page_or_len, block_table.shape[1] * page_or_len, slots
    else:
        if slots != B:
            raise ValueError(f"k_cache must have batch size {B} (as q), got {slots}")
        page_size, capacity, num_pages = 0, page_or_len, 0
    cache_seqlens = _tensor("cache_seqlens", cache_seqlens, 1, "int32 [B]")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on the device of q ({device}), got {cache_seqlens.device}")
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens must have shape [B] = [{B}], got {tuple(cache_seqlens.shape)}")
    new_keys = _validate_new(k_new, v_new, q, B, Hkv, D, Dv)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    if scale is not None and not abs(float(scale)) < float(torch.finfo(torch.float32).max):
        raise ValueError(f"scale must be finite in float32, got {scale!r}")
    window = _validate_window(window, Nq, capacity)
    softcap = _validate_softcap(softcap)
    if alibi_slopes is not None:
        _validate_alibi_slopes(alibi_slopes, B, H, q, False)
    if check_values and B > 0:
        _check_values(cache_seqlens, new_keys, capacity, block_table, page_size, num_pages)
    problem = Problem(
        batch=B,
        heads=H,
        kv_heads=Hkv,
        seqlen_q=Nq,
        seqlen_k=capacity,
        head_dim=D,
        dtype=q.dtype,
        device=device.type,
        causal=causal,
        scale=float(default_scale(q, scale)),
        is_numpy=False,
        device_name=str(device),
        head_dim_v=Dv,
        window=window,
        softcap=softcap,
        seqlens_k=cache_seqlens,
        alibi_slopes=alibi_slopes,
    )
    return KVCacheProblem(problem=problem, page_size=page_size, new_keys=new_keys, num_pages=num_pages)


def _validate_new(k_new: Any, v_new: Any, q: Tensor, B: int, Hkv: int, D: int, Dv: int) -> int:
    """``Nnew``: 0 without new keys; ``k_new`` ``[B, Hkv, Nnew, D]`` and ``v_new`` ``[B, Hkv, Nnew, Dv]`` together."""
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} was given without {missing}: the append needs both (or neither)")
    if k_new is None:
        return 0
    k_new = _tensor("k_new", k_new, 4, "[B, Hkv, Nnew, D]")
    v_new = _tensor("v_new", v_new, 4, "[B, Hkv, Nnew, Dv]")
    for name, x, d in (("k_new", k_new, D), ("v_new", v_new, Dv)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
        if tuple(x.shape[:2]) != (B, Hkv) or x.shape[3] != d:
            raise ValueError(
                f"{name} must have shape [B, Hkv, Nnew, {d}] = [{B}, {Hkv}, Nnew, {d}], got {tuple(x.shape)}"
            )
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(f"k_new and v_new must have the same Nnew, got {k_new.shape[2]} and {v_new.shape[2]}")
    return int(k_new.shape[2])


def _check_values(
    cache_seqlens: Tensor, new_keys: int, capacity: int, block_table: Tensor | None, page_size: int, num_pages: int
) -> None:
    """The value checks, read back in one synchronisation (each host read of a GPU value waits for the GPU)."""
    lengths = cache_seqlens.to(torch.int64)
    stats = [lengths.min(), lengths.max()]
    if block_table is not None:
        # Only the pages that hold keys of the attended length must be valid (a table may pad its rows with -1).
        used = torch.arange(block_table.shape[1], device=block_table.device) * page_size < (lengths + new_keys)[:, None]
        entries = block_table.to(torch.int64)
        top, bottom = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min  # no page in use: low > high
        stats += [torch.where(used, entries, top).min(), torch.where(used, entries, bottom).max()]
    low, high, *pages = torch.stack(stats).tolist()
    if low < 0 or high + new_keys > capacity:
        raise ValueError(
            f"cache_seqlens + Nnew must lie in [0, capacity] = [0, {capacity}] (Nnew = {new_keys}), got cache_seqlens "
            f"from {low} to {high}"
        )
    if pages and pages[0] <= pages[1] and (pages[0] < 0 or pages[1] >= num_pages):  # some page in use, one invalid
        raise ValueError(
            f"block_table entries of the pages in use must lie in [0, num_pages) = [0, {num_pages}), got "
            f"{pages[0]} to {pages[1]}"
        )


def append_(
    k_cache: Tensor,
    v_cache: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache_seqlens: Tensor,
    block_table: Tensor | None,
) -> None:
    """Write ``k_new``/``v_new`` ``[B, Hkv, Nnew, D]`` into the caches at positions ``cache_seqlens[b] + j``.

    Index arithmetic on the caches' device and one indexed write per cache: no host synchronisation.  Only those
    ``B * Nnew`` key rows are written.
    """
    B, _, new_keys, _ = k_new.shape
    if B * new_keys == 0:
        return
    device = k_cache.device
    positions = cache_seqlens.to(torch.int64)[:, None] + torch.arange(new_keys, device=device)  # [B, Nnew]
    if block_table is None:
        outer = torch.arange(B, device=device)[:, None].expand(B, new_keys)
        inner = positions
    else:
        page_size = k_cache.shape[2]
        outer = block_table.to(torch.int64).gather(1, positions // page_size)
        inner = positions % page_size
    # cache.transpose(1, 2)[outer, inner] is the [B, Nnew, Hkv, D] set of rows; assigning through the view writes
    # the cache's own storage.
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        cache.transpose(1, 2)[outer, inner] = new.transpose(1, 2)


def gather_sequence(cache: Tensor, block_table: Tensor | None, b: int, length: int) -> Tensor:
    """Keys ``0 .. length - 1`` of sequence ``b`` as a dense ``[1, Hkv, length, D]`` tensor.

    Dense cache: ``cache[b, :, :length]``.  Paged: key ``t`` is ``cache[block_table[b, t // page_size], :,
    t % page_size]``.
    """
    if block_table is None:
        return cache[b : b + 1, :, :length]
    page_size = cache.shape[2]
    t = torch.arange(length, device=cache.device)
    pages = block_table[b, t // page_size].to(torch.int64)
    # Two index tensors around a slice: the indexed dim (t) comes first, [length, Hkv, D].
    return cache[pages, :, t % page_size].transpose(0, 1).unsqueeze(0)


def per_sequence_forward(
    backend: Backend, q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, block_table: Tensor | None, kv
) -> tuple[Tensor, Tensor]:
    """The KV-cache call as the reference backends answer it: each sequence's keys gathered into a dense tensor of
    exactly its attended length ``L_b``, then ``backend.forward`` on it, where bottom-right alignment to Nk = L_b is
    the KV-cache call's alignment.  Reads ``lengths`` on the host (a synchronisation: references only)."""
    p = kv.problem
    slopes = p.alibi_slopes
    o_parts, lse_parts = [], []
    for b, length in enumerate(lengths.tolist()):
        k_b = gather_sequence(k_cache, block_table, b, length)
        v_b = gather_sequence(v_cache, block_table, b, length)
        slopes_b = slopes[b : b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        o_b, lse_b = backend.forward(
            q[b : b + 1], k_b, v_b, causal=p.causal, scale=p.scale, window=p.window, softcap=p.softcap,
            alibi_slopes=slopes_b,
        )  # fmt: skip
        o_parts.append(o_b)
        lse_parts.append(lse_b)
    return torch.cat(o_parts), torch.cat(lse_parts)


def dense_copy(cache: Tensor, block_table: Tensor) -> Tensor:
    """A paged cache ``[num_pages, Hkv, page_size, D]`` as the dense ``[B, Hkv, max_pages * page_size, D]`` that its
    block table describes (one gather on the device; pages past a sequence's length are copied too, and masked by
    its length)."""
    B, max_pages = block_table.shape
    _, Hkv, page_size, D = cache.shape
    pages = cache[block_table.to(torch.int64).clamp(0, cache.shape[0] - 1)]  # [B, max_pages, Hkv, page_size, D]
    return pages.transpose(1, 2).reshape(B, Hkv, max_pages * page_size, D)


# -- backend choice -----------------------------------------------------------------------------------------------
def kvcache_reasons(backend: Backend, kv: KVCacheProblem) -> list[str]:
    """Why ``backend`` cannot answer this KV-cache call ([] when it can)."""
    if not backend.capabilities.kvcache:
        return ["the KV-cache call (attention_with_kvcache) is not supported"]
    return backend.reasons_for(kv.problem) + backend.kvcache_reasons(kv)


def _pick(kv: KVCacheProblem) -> Backend:
    return pick_ranked(
        kv.problem.device,
        lambda backend: backend.capabilities.kvcache_auto_rank,
        lambda backend: kvcache_reasons(backend, kv),
        "no registered backend answers this KV-cache call",
    )


def _backend_for(key: str, kv: KVCacheProblem) -> Backend:
    backend = _pick(kv) if key == "auto" else _backend_of(key, kv.problem)
    reasons = kvcache_reasons(backend, kv)
    if reasons:
        raise NotImplementedError(
            f"backend {backend.name!r} does not support this KV-cache call: " + "; ".join(reasons)
        )
    return backend


# -- the operator -------------------------------------------------------------------------------------------------
@torch.library.custom_op("attnzoo::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_new: Tensor | None,
    v_new: Tensor | None,
    block_table: Tensor | None,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """Append, then attend: ``o`` ``[B, H, Nq, Dv]`` (dtype of q), ``lse`` ``[B, H, Nq]`` (float32; float64 for
    float64).  Shapes are checked here; values only by :func:`attention_with_kvcache` in eager mode."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    kv = validate_kvcache(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, window, softcap, alibi_slopes,
        check_values=False,
    )  # fmt: skip
    chosen = _backend_for(backend, kv)
    if k_new is not None:
        append_(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
    p = kv.problem
    if p.batch * p.heads * p.seqlen_q == 0:
        return q.new_zeros((p.batch, p.heads, p.seqlen_q, p.head_dim_v)), q.new_zeros(
            (p.batch, p.heads, p.seqlen_q), dtype=lse_dtype(q.dtype)
        )
    lengths = (cache_seqlens + kv.new_keys).contiguous()  # the attended length of each sequence
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return chosen.kvcache_forward(q, k_cache, v_cache, lengths, block_table, kv)


@attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, wl, wr, softcap, slopes, backend):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v_cache.shape[3])), q.new_empty((B, H, Nq), dtype=lse_dtype(q.dtype))


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    block_table: Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    backend: str | Backend = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``q`` over a KV cache, after appending ``k_new``/``v_new`` to it in place (SPEC.md).

    q: ``[B, H, Nq, D]``.  Dense cache: ``k_cache`` ``[B, Hkv, Ncache, D]``, ``v_cache`` ``[B, Hkv, Ncache, Dv]``.
    Paged cache: ``[num_pages, Hkv, page_size, D]`` (and ``Dv``) with ``block_table`` int32 ``[B, max_pages]``; any
    strides (a ``[num_pages, page_size, Hkv, D]`` buffer passes as ``.transpose(1, 2)``).  ``cache_seqlens`` int32
    ``[B]``: valid keys before the append (not modified).  ``k_new``/``v_new`` ``[B, Hkv, Nnew, D]``: written at
    positions ``cache_seqlens[b] ..`` and attended; nothing else in the cache is written.  The attended length is
    ``cache_seqlens + Nnew``; ``causal`` (default True), ``window`` and ALiBi align bottom-right to it.  Returns ``o``
    ``[B, H, Nq, Dv]``, or ``(o, lse)`` with ``return_lse`` (lse ``[B, H, Nq]`` float32, float64 for float64).
    No autograd.  Works under ``torch.compile(fullgraph=True)`` and CUDA-graph capture.
    """
    key = backend_key(backend)
    if not torch.compiler.is_compiling():
        capturing = isinstance(q, Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()
        kv = validate_kvcache(
            q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, window, softcap,
            alibi_slopes, check_values=not capturing,
        )  # fmt: skip
        _backend_for(key, kv)  # an unsupported call fails here, before anything is written
    left, right = (None, None) if window is None else window
    o, lse = attention_with_kvcache_op(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, bool(causal), float(default_scale(q, scale)),
        left, right, float(softcap), alibi_slopes, key,
    )  # fmt: skip
    return (o, lse) if return_lse else o
