"""``@triton.jit`` helpers shared by the forward, the two-kernel backward and the atomic backward.

Conventions used by every kernel:

- Scores are kept in base-2 units: ``s2 = (q . k) * scale * log2(e)``, so that ``exp(s - m)`` becomes
  ``exp2(s2 - m2)`` (one MUFU.EX2 instruction, no extra multiply).  The saved ``lse`` is natural-log; kernels
  convert it with one multiply per row (``lse2 = lse * log2(e)``).
- Mask convention: causal is bottom-right aligned, row ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``;
  ``seqlens_k[b]`` hides keys ``j >= seqlens_k[b]``.
- Batch/head offsets are int64 (a tensor may have more than 2^31 elements); offsets inside a tile are int32
  relative to a per-tile int64 base; they stay below 2^31 because the host copies a view whose row stride is
  too large for that to contiguous memory first (`launch.int32_addressable`).
- K/V tiles are loaded only up to ``seqlen_k_b`` (the batch's key count): keys past it are read as zeros, so
  whatever memory holds there (even NaN) never reaches ``P @ V``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): ln(x) = log2(x) * LN2


@triton.jit
def as_int64(x):
    """``x`` widened to int64 (works on int32 tensors and on the plain ints of the interpreter's loops)."""
    return x + tl.zeros([], tl.int64)


@triton.jit
def head_pointer(ptr, batch, head, stride_b, stride_h):
    """Base pointer of one (batch, head) matrix, with int64 offsets (tensors of more than 2^31 elements)."""
    return ptr + as_int64(batch) * stride_b + as_int64(head) * stride_h


@triton.jit
def tile_pointers(base, first_row, local_rows, cols, stride_row, stride_col):
    """Pointers ``[len(local_rows), len(cols)]`` of the tile whose first row is ``first_row``.

    The row start goes into the int64 scalar base; the per-element offsets stay small int32.
    """
    base = base + as_int64(first_row) * stride_row
    return base + local_rows[:, None] * stride_row + cols[None, :] * stride_col


@triton.jit
def tile_in_bounds(rows, row_limit, cols, head_dim, EVEN_D: tl.constexpr):
    """The mask of rows ``< row_limit`` and columns ``< head_dim`` of a ``[rows, BLOCK_D]`` tile.

    With EVEN_D it is the ``[rows, 1]`` row test alone (broadcast by the store): a mask constant along a row
    lets the compiler keep 16-byte vector stores, where the column test against the runtime ``head_dim``
    made every element a 2-byte store (seen in the PTX of the forward; docs/design.md).
    """
    if EVEN_D:
        in_bounds = rows[:, None] < row_limit
    else:
        in_bounds = (rows[:, None] < row_limit) & (cols[None, :] < head_dim)
    return in_bounds


@triton.jit
def load_tile(ptrs, rows, row_limit, cols, head_dim, EVEN_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a ``[rows, BLOCK_D]`` tile; rows ``>= row_limit`` (when CHECK_ROWS) and columns ``>= head_dim`` read 0.

    EVEN_D: the head dim equals the tile width (a power of two), so no column mask.  Without CHECK_ROWS and
    with EVEN_D the load carries no predicate at all, which lets the compiler issue wide unpredicated copies
    in the unmasked stage of the loops.
    """
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=tile_in_bounds(rows, row_limit, cols, head_dim, EVEN_D), other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < head_dim, other=0.0)
    return tile


@triton.jit
def load_kv_tile(
    head, desc, batch, kv_head, start_n, local_n, cols, stride_n, stride_d, seqlen_k_b, head_dim,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_D]`` K or V tile of keys ``start_n + local_n`` of one (batch, kv head).

    USE_TMA: one asynchronous copy through the descriptor ``desc`` (a ``[1, 1, BLOCK_N, BLOCK_D]`` box): the copy
    engine addresses it, so no pointer tensor is kept in registers.  Only for tiles that need no mask (not MASKED):
    a descriptor zero-fills rows past Nk, but not keys past ``seqlens_k[b]``, which must read as zeros.  Otherwise
    pointer loads from ``head``; MASKED: keys ``>= seqlen_k_b`` read as zeros.
    """
    if USE_TMA:
        tile = desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        tile = load_tile(
            tile_pointers(head, start_n, local_n, cols, stride_n, stride_d), start_n + local_n, seqlen_k_b, cols,
            head_dim, EVEN_D, MASKED,
        )  # fmt: skip
    return tile


@triton.jit
def store_tile(ptrs, value, rows, row_limit, cols, head_dim, EVEN_D: tl.constexpr):
    """Store a ``[rows, BLOCK_D]`` tile, skipping rows ``>= row_limit`` and columns ``>= head_dim``."""
    tl.store(ptrs, value, mask=tile_in_bounds(rows, row_limit, cols, head_dim, EVEN_D))


@triton.jit
def key_visible(q_idx, k_idx, diagonal_offset, seqlen_k_b, CAUSAL: tl.constexpr):
    """Whether query row ``q_idx`` sees key ``k_idx`` (broadcast: pass ``[M, 1]`` and ``[1, N]`` or transposed).

    ``diagonal_offset = Nk - Nq`` (bottom-right causal alignment).
    """
    visible = k_idx < seqlen_k_b
    if CAUSAL:
        visible = visible & (k_idx <= q_idx + diagonal_offset)
    return visible


@triton.jit
def batch_seqlen_k(seqlens_ptr, batch, seqlen_k, HAS_SEQLENS: tl.constexpr):
    """Number of keys batch ``batch`` may see (``seqlens_k[batch]``, or ``Nk`` without seqlens_k)."""
    if HAS_SEQLENS:
        n = tl.load(seqlens_ptr + batch).to(tl.int32)
    else:
        n = seqlen_k + tl.zeros([], tl.int32)
    return n


@triton.jit
def q_block_program(pid, num_m_blocks, num_heads, group_size, CAUSAL: tl.constexpr):
    """Which Q block of which (batch, head) program ``pid`` of a Q-stationary grid (num_m_blocks * B * H programs)
    computes -> ``(bh, m_block, batch, head, kv_head)``.

    Consecutive programs share a (batch, head), so its K/V stays in L2 across them.  With CAUSAL the block order is
    reversed so that the longest rows (most K/V tiles) start first and the tail of the grid is short.
    """
    bh = pid // num_m_blocks
    m_block = pid % num_m_blocks
    if CAUSAL:
        m_block = num_m_blocks - 1 - m_block
    batch = bh // num_heads
    head = bh % num_heads
    return bh, m_block, batch, head, head // group_size


@triton.jit
def kv_loop_bounds(
    start_m,
    seqlen_q,
    seqlen_k,
    seqlen_k_b,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key ranges for a Q-stationary program whose rows start at ``start_m`` -> ``(unmasked_end, end)``.

    ``[0, unmasked_end)`` is a whole number of K/V tiles that every row of the block sees entirely (no mask
    arithmetic needed); ``[unmasked_end, end)`` holds the diagonal/padding tiles that need the mask; tiles
    from ``end`` on are hidden from every real row and are never loaded (block early exit).
    """
    diagonal_offset = seqlen_k - seqlen_q
    if CAUSAL:
        # The last real row of the block sees keys j <= last_row + offset; the first row j <= start_m + offset.
        last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
        end = tl.minimum(seqlen_k_b, last_row + 1 + diagonal_offset)
        unmasked_end = tl.minimum(seqlen_k_b, start_m + 1 + diagonal_offset)
    else:
        end = seqlen_k_b
        unmasked_end = seqlen_k_b
    end = tl.maximum(end, 0)
    unmasked_end = (tl.maximum(unmasked_end, 0) // BLOCK_N) * BLOCK_N
    return unmasked_end, end


@triton.jit
def q_loop_bounds(
    start_n,
    seqlen_q,
    seqlen_k,
    seqlen_k_b,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query-row ranges for a K/V-stationary program whose keys start at ``start_n`` -> ``(lo, unmasked_lo, hi)``.

    Q tiles ``[lo, unmasked_lo)`` need the mask (diagonal tiles, or all tiles when the key block reaches past
    ``seqlen_k_b``); ``[unmasked_lo, hi)`` see every key of the block.  Rows before ``lo`` see none of its keys
    and are never loaded; ``lo == hi`` when the block lies wholly past ``seqlen_k_b``.
    """
    diagonal_offset = seqlen_k - seqlen_q
    hi = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # Row i sees key j iff i >= j - offset: the first row that sees the block's first key ...
        first_row = tl.maximum(start_n - diagonal_offset, 0)
        # ... and the first row that sees its last key.
        full_row = tl.maximum(start_n + BLOCK_N - 1 - diagonal_offset, 0)
        lo = tl.where(first_row < seqlen_q, (first_row // BLOCK_M) * BLOCK_M, hi)
        unmasked_lo = tl.cdiv(full_row, BLOCK_M) * BLOCK_M
    else:
        lo = hi * 0
        unmasked_lo = hi * 0
    # A key block cut by seqlen_k_b needs the mask on every Q tile; one wholly past it is skipped.
    unmasked_lo = tl.where(start_n + BLOCK_N > seqlen_k_b, hi, unmasked_lo)
    lo = tl.where(start_n >= seqlen_k_b, hi, lo)
    unmasked_lo = tl.minimum(tl.maximum(unmasked_lo, lo), hi)
    return lo, unmasked_lo, hi


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, qk_scale, v_tile, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One FA2 online-softmax update with a ``[BLOCK_M, BLOCK_N]`` tile ``qk`` of scores (``-inf`` = hidden).

    The base-2 scores are ``qk * qk_scale`` with ``qk_scale > 0``; the scale is applied inside ``exp2``'s
    argument, one FFMA per score instead of a multiply and a subtract, which matters where the softmax's
    per-score instructions compete with the matrix products (small head dims).  Because the scale is positive,
    the row max of the scaled scores is the row max of ``qk`` times the scale.
    m_i: running row max (base 2), l_i: running row sum of ``exp2(s2 - m_i)``, acc: unnormalised output.
    Normalisation is deferred to the end of the loop (one division per row instead of one per tile).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # A row that has seen no visible key keeps m = -inf; shifting by 0 keeps exp2(-inf - -inf) = NaN out
        # (alpha and p are then exactly 0).  Unmasked tiles always raise m to a finite value.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def load_lse2(lse_ptrs, rows, seqlen_q, CHECK_ROWS: tl.constexpr):
    """Row LSE in base-2 units; empty rows (lse = -inf) give +inf so that P = exp2(s - lse) = 0.

    CHECK_ROWS: rows past ``seqlen_q`` also give +inf (a predicated load); without it every row must be real.
    """
    if CHECK_ROWS:
        lse = tl.load(lse_ptrs, mask=rows < seqlen_q, other=float("inf"))
    else:
        lse = tl.load(lse_ptrs)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * 1.4426950408889634


@triton.jit
def row_delta(o_tile, do_tile):
    """``Delta_i = rowsum(dO_i * O_i)`` of a ``[rows, BLOCK_D]`` tile pair, in float32 (= ``rowsum(dP_i * P_i)``)."""
    return tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)


@triton.jit
def recompute_p(scores_raw, lse2, qk_scale, visible, MASKED: tl.constexpr):
    """``P = exp(S - lse)`` of one tile from its raw scores, as ``exp2(s * qk_scale - lse2)`` (one FFMA + EX2).

    ``lse2`` comes already broadcast to the tile's orientation (``[M, 1]`` for a ``[M, N]`` tile, ``[1, M]`` for
    the transposed ``[N, M]`` tile of the K/V-stationary kernel).  MASKED: hidden entries give exactly 0.
    """
    p = tl.math.exp2(scores_raw * qk_scale - lse2)
    if MASKED:
        p = tl.where(visible, p, 0.0)
    return p


@triton.jit
def softmax_grad_tile(scores_raw, dp, lse2, delta, qk_scale, visible, MASKED: tl.constexpr):
    """Recompute ``P`` (see ``recompute_p``) and ``dS = P * (dP - Delta)`` for one tile -> ``(p, ds)``."""
    p = recompute_p(scores_raw, lse2, qk_scale, visible, MASKED)
    ds = p * (dp - delta)
    return p, ds
