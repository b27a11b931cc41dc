"""``@triton.jit`` helpers shared by the forward, the two-kernel backward and the atomic backward.

Conventions used by every kernel:

- Scores are kept in base-2 units: ``s2 = (q . k) * scale * log2(e)``, so that ``exp(s - m)`` becomes
  ``exp2(s2 - m2)`` (one MUFU.EX2 instruction, no extra multiply).  The saved ``lse`` is natural-log; kernels
  convert it with one multiply per row (``lse2 = lse * log2(e)``).
- Mask convention (SPEC.md), with ``i' = i + (Nk - Nq)``: causal is bottom-right aligned, row ``i`` sees key ``j``
  iff ``j <= i'``; a window ``(left, right)`` keeps ``i' - left <= j <= i' + right``; ``seqlens_k[b]`` hides keys
  ``j >= seqlens_k[b]``.  Causal and the window are one band of diagonals ``-left <= j - i' <= right`` (causal caps
  ``right`` at 0).  The host passes a bounded side as a runtime int with a constexpr flag (WINDOW_LEFT,
  WINDOW_RIGHT), so that calls without a window compile exactly as before; WINDOW_RIGHT is set only for a right
  bound that causal does not already imply (``right < 0`` with causal).
- Score modifiers, in SPEC.md's order after the scale: the soft cap (``softcap_scores``), ALiBi (``alibi_scores``),
  then the masks.  Each is a constexpr flag (SOFTCAP, ALIBI): without it no code is emitted.
- Batch/head offsets are int64 (a tensor may have more than 2^31 elements); offsets inside a tile are int32
  relative to a per-tile int64 base; they stay below 2^31 because the host copies a view whose row stride is
  too large for that to contiguous memory first (`launch.int32_addressable`).
- K/V tiles are loaded only up to ``seqlen_k_b`` (the batch's key count): keys past it are read as zeros, so
  whatever memory holds there (even NaN) never reaches ``P @ V``.
- A kernel takes each ``[B, H, N, D]`` tensor as its pointer followed by its four strides (``launch.tensor_args``
  on the host) and regroups them into a tuple ``(ptr, stride_b, stride_h, stride_n, stride_d)``; ``head_rows``
  picks one (batch, head) matrix of it, ``(base, stride_n, stride_d)``, which ``load_rows``/``store_rows`` and the
  stages take.  Every kernel opens the same way: its program id names a block of one (batch, head)
  (``q_block_opening`` for the Q-stationary grids, ``kv_block_opening`` for the K/V-stationary one), then the
  matrices of that (batch, head), then the resident tiles.
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
def head_rows(tensor, batch, head):
    """One (batch, head) matrix of a ``[B, H, N, D]`` tensor ``(ptr, stride_b, stride_h, stride_n, stride_d)`` ->
    ``(base, stride_n, stride_d)``, the base offset in int64."""
    ptr, stride_b, stride_h, stride_n, stride_d = tensor
    return head_pointer(ptr, batch, head, stride_b, stride_h), stride_n, stride_d


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
def load_rows(matrix, start, local_rows, cols, row_limit, head_dim, EVEN_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The tile of rows ``start + local_rows`` of a ``head_rows`` matrix (``load_tile``'s masking)."""
    base, stride_n, stride_d = matrix
    return load_tile(
        tile_pointers(base, start, local_rows, cols, stride_n, stride_d), start + local_rows, row_limit, cols,
        head_dim, EVEN_D, CHECK_ROWS,
    )  # fmt: skip


@triton.jit
def store_rows(matrix, value, start, local_rows, cols, row_limit, head_dim, EVEN_D: tl.constexpr):
    """Store ``value`` (cast to the matrix's dtype) as the rows ``start + local_rows`` of a ``head_rows`` matrix,
    skipping rows ``>= row_limit`` and columns ``>= head_dim``."""
    base, stride_n, stride_d = matrix
    store_tile(
        tile_pointers(base, start, local_rows, cols, stride_n, stride_d), value.to(base.dtype.element_ty),
        start + local_rows, row_limit, cols, head_dim, EVEN_D,
    )  # fmt: skip


@triton.jit
def load_kv_tile(
    matrix, desc, batch, kv_head, start_n, local_n, cols, seqlen_k_b, head_dim,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_D]`` K or V tile of keys ``start_n + local_n`` of one (batch, kv head).

    USE_TMA: one asynchronous copy through the descriptor ``desc`` (a ``[1, 1, BLOCK_N, BLOCK_D]`` box): the copy
    engine addresses it, so no pointer tensor is kept in registers.  Only for tiles that need no mask (not MASKED):
    a descriptor zero-fills rows past Nk, but not keys past ``seqlens_k[b]``, which must read as zeros.  Otherwise
    pointer loads from the ``head_rows`` matrix; MASKED: keys ``>= seqlen_k_b`` read as zeros.
    """
    if USE_TMA:
        tile = desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        tile = load_rows(matrix, start_n, local_n, cols, seqlen_k_b, head_dim, EVEN_D, MASKED)
    return tile


@triton.jit
def store_tile(ptrs, value, rows, row_limit, cols, head_dim, EVEN_D: tl.constexpr):
    """Store a ``[rows, BLOCK_D]`` tile, skipping rows ``>= row_limit`` and columns ``>= head_dim``."""
    tl.store(ptrs, value, mask=tile_in_bounds(rows, row_limit, cols, head_dim, EVEN_D))


@triton.jit
def key_visible(
    q_idx, k_idx, diagonal_offset, seqlen_k_b, window_left, window_right,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
):  # fmt: skip
    """Whether query row ``q_idx`` sees key ``k_idx`` (broadcast: pass ``[M, 1]`` and ``[1, N]`` or transposed).

    ``diagonal_offset = Nk - Nq`` (bottom-right alignment); ``window_left``/``window_right`` are read only with their
    flags.
    """
    visible = k_idx < seqlen_k_b
    if CAUSAL:
        visible = visible & (k_idx <= q_idx + diagonal_offset)
    if WINDOW_RIGHT:
        visible = visible & (k_idx <= q_idx + (diagonal_offset + window_right))
    if WINDOW_LEFT:
        visible = visible & (k_idx >= q_idx + (diagonal_offset - window_left))
    return visible


@triton.jit
def fp8_factors(descale_ptr, batch, kv_head, num_kv_heads):
    """FP8 inputs' factors of one (batch, kv head) from the float32 ``[B, Hkv, 3]`` table (``attnzoo.fp8``) ->
    ``(q_factor, k_factor, v_factor)``: the stored scores times the q and k factors are the real ones, and ``P V`` of
    the stored v times the v factor is the real one."""
    factors = descale_ptr + (batch * num_kv_heads + kv_head) * 3
    return tl.load(factors), tl.load(factors + 1), tl.load(factors + 2)


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
def varlen_block(slot, cu_seqlens_ptr, num_sequences, search_steps, BLOCK: tl.constexpr):
    """Which block of which sequence slot ``slot`` of a packed grid computes -> ``(sequence, block, first_row,
    length)``, from the int32 offsets ``cu_seqlens`` ``[B + 1]`` alone (no host read, no prefix sum of block counts).

    Sequence ``b`` (rows ``[s, e)``) owns the slots ``[t_b, t_{b+1})`` with ``t_b = s // BLOCK + b``: that is
    ``e // BLOCK - s // BLOCK + 1`` slots, at least ``cdiv(e - s, BLOCK)`` and at most one more.  So a grid of
    ``total // BLOCK + B`` slots covers every block of every sequence, with at most one idle slot per sequence (its
    ``block * BLOCK >= length``: the program returns at once).  ``t`` increases strictly with ``b``; the sequence is
    the last ``b`` with ``t_b <= slot``, found by bisection in ``search_steps = ceil(log2(B + 1))`` steps.

    The steps are unrolled up to B < 2^31, each under a run-time test: as a run-time loop, the bisection cost the
    kernels' main loops registers (ptxas, the Gluon forward's 64x128 tile at D = 64: 180 against 164 unrolled, and
    3 CTAs per SM need at most 168).
    """
    lo = slot * 0  # int32 scalars made from the slot, not tl.zeros: Gluon's zeros would need a layout
    hi = lo + num_sequences  # invariant: t_lo <= slot < t_hi (t_B is the slot count)
    for step in tl.static_range(31):
        if step < search_steps:
            mid = (lo + hi) // 2
            below = tl.load(cu_seqlens_ptr + mid) // BLOCK + mid <= slot
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
    first = tl.load(cu_seqlens_ptr + lo)
    length = tl.load(cu_seqlens_ptr + lo + 1) - first
    return lo, slot - (first // BLOCK + lo), first, length


@triton.jit
def q_block_opening(
    pid, num_m_blocks, num_heads, group_size, seqlens_ptr, seqlen_q, seqlen_k, varlen,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """The opening of a Q-stationary program (the forward, the dQ kernel, the atomic backward) ->
    ``(bh, m_block, batch, head, kv_head, start_m, q_first, k_first, seqlen_q, seqlen_k, seqlen_k_b)``; a kernel
    rebinds its ``seqlen_q``/``seqlen_k`` to the returned ones.

    Dense (grid ``num_m_blocks * B * H``): the block of ``q_block_program``; ``q_first = k_first = batch`` index the
    tensors' batch dim (``head_rows``), ``seqlen_q``/``seqlen_k`` are Nq and Nk as given (they set the bottom-right
    diagonal), ``seqlen_k_b`` the keys the batch may see (``batch_seqlen_k``).
    VARLEN, a packed batch (``varlen = (cu_seqlens_q, cu_seqlens_k, B, search_steps)``; grid ``num_m_blocks * H``
    with ``num_m_blocks = total_q // BLOCK_M + B`` slots per head, ``varlen_block``): ``batch`` is the sequence,
    ``q_first``/``k_first`` its first query and key rows (the host passes a packed tensor's row stride as its batch
    stride, so ``head_rows`` addresses them), the lengths its own.  ``start_m >= seqlen_q``: an idle slot.
    """
    if VARLEN:
        cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps = varlen
        head = pid // num_m_blocks
        slot = pid % num_m_blocks
        if CAUSAL:  # the longest rows of each sequence first, as q_block_program does
            slot = num_m_blocks - 1 - slot
        batch, m_block, q_first, seq_q = varlen_block(slot, cu_seqlens_q, num_sequences, search_steps, BLOCK_M)
        k_first = tl.load(cu_seqlens_k + batch)
        seq_k = tl.load(cu_seqlens_k + batch + 1) - k_first
        bh = head
        kv_head = head // group_size
        seqlen_k_b = seq_k
    else:
        bh, m_block, batch, head, kv_head = q_block_program(pid, num_m_blocks, num_heads, group_size, CAUSAL)
        seqlen_k_b = batch_seqlen_k(seqlens_ptr, batch, seqlen_k, HAS_SEQLENS)
        q_first = batch
        k_first = batch
        seq_q = seqlen_q
        seq_k = seqlen_k
    return bh, m_block, batch, head, kv_head, m_block * BLOCK_M, q_first, k_first, seq_q, seq_k, seqlen_k_b


@triton.jit
def kv_block_opening(
    pid, num_n_blocks, num_kv_heads, seqlens_ptr, seqlen_q, seqlen_k, varlen,
    BLOCK_N: tl.constexpr, HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """The opening of a K/V-stationary program (the dK/dV kernel; grid num_n_blocks * B * Hkv) ->
    ``(batch, kv_head, start_n, q_first, k_first, seqlen_q, seqlen_k, seqlen_k_b)`` as ``q_block_opening``
    names them.  Consecutive programs share a (batch, kv head).  VARLEN: grid ``num_n_blocks * Hkv`` with
    ``num_n_blocks = total_k // BLOCK_N + B`` slots per K/V head; ``start_n >= seqlen_k``: an idle slot."""
    if VARLEN:
        cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps = varlen
        kv_head = pid // num_n_blocks
        batch, n_block, k_first, seq_k = varlen_block(
            pid % num_n_blocks, cu_seqlens_k, num_sequences, search_steps, BLOCK_N
        )
        q_first = tl.load(cu_seqlens_q + batch)
        seq_q = tl.load(cu_seqlens_q + batch + 1) - q_first
        seqlen_k_b = seq_k
    else:
        bh_kv = pid // num_n_blocks
        batch = bh_kv // num_kv_heads
        kv_head = bh_kv % num_kv_heads
        n_block = pid % num_n_blocks
        seqlen_k_b = batch_seqlen_k(seqlens_ptr, batch, seqlen_k, HAS_SEQLENS)
        q_first = batch
        k_first = batch
        seq_q = seqlen_q
        seq_k = seqlen_k
    return batch, kv_head, n_block * BLOCK_N, q_first, k_first, seq_q, seq_k, seqlen_k_b


@triton.jit
def row_stats_offset(bh, head, q_first, seqlen_q, VARLEN: tl.constexpr):
    """Offset (int64) of a program's first row in a per-row statistic (lse, lse2, Delta): dense ``[B, H, Nq]``
    (``bh * Nq``); VARLEN ``[H, total_q]`` (``head * total_q + q_first``, the kernel's ``seqlen_q`` being total_q)."""
    if VARLEN:
        offset = as_int64(head) * seqlen_q + q_first
    else:
        offset = as_int64(bh) * seqlen_q
    return offset


@triton.jit
def band_is_empty(window_left, window_right, WINDOW_RIGHT: tl.constexpr):
    """Whether the band ``-left <= j - i' <= right`` holds no diagonal (``left + right < 0``): no row sees any key.

    For a bounded left side and a bounded right one: ``window_right`` with WINDOW_RIGHT, else causal's 0.
    """
    if WINDOW_RIGHT:
        empty = window_left + window_right < 0
    else:
        empty = window_left < 0
    return empty


@triton.jit
def kv_loop_bounds(
    start_m, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key ranges of a Q-stationary program whose rows start at ``start_m`` ->
    ``(start, unmasked_start, unmasked_end, end)``.

    ``[unmasked_start, unmasked_end)`` is a whole number of K/V tiles that every real row of the block sees entirely
    (no mask arithmetic); ``[start, unmasked_start)`` holds the tiles cut by the window's left edge and
    ``[unmasked_end, end)`` those cut by the right edge (the causal diagonal) or by the padding: both need the mask.
    Tiles outside ``[start, end)`` are hidden from every real row and never loaded.  Without WINDOW_LEFT, ``start`` and
    ``unmasked_start`` are 0 (the stage before the unmasked one is not compiled).

    The keys some real row of the block sees form one interval, ``[first' - left, last' + right]`` (consecutive rows
    shift the band by one key), so every tile of ``[start, end)`` is visited for a reason: the debug counts are exact.
    """
    diagonal_offset = seqlen_k - seqlen_q
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    if CAUSAL or WINDOW_RIGHT:
        # The last real row of the block sees keys j <= last_row + offset + right; the first row
        # j <= start_m + offset + right (right = 0 for causal alone).
        if WINDOW_RIGHT:
            right_diagonal = diagonal_offset + window_right
        else:
            right_diagonal = diagonal_offset
        end = tl.minimum(seqlen_k_b, last_row + 1 + right_diagonal)
        unmasked_end = tl.minimum(seqlen_k_b, start_m + 1 + right_diagonal)
    else:
        end = seqlen_k_b
        unmasked_end = seqlen_k_b
    end = tl.maximum(end, 0)
    unmasked_end = (tl.maximum(unmasked_end, 0) // BLOCK_N) * BLOCK_N
    start = 0
    unmasked_start = 0
    if WINDOW_LEFT:
        # The first row sees keys j >= start_m + offset - left, the last real row j >= last_row + offset - left.
        left_diagonal = diagonal_offset - window_left
        first_key = tl.maximum(start_m + left_diagonal, 0)
        start = (first_key // BLOCK_N) * BLOCK_N
        unmasked_start = tl.cdiv(tl.maximum(last_row + left_diagonal, 0), BLOCK_N) * BLOCK_N
        # No key from first_key on is seen (the right bound or seqlens_k ends before it): nothing, not even the
        # tile that start rounds down to.
        end = tl.where(end > first_key, end, start)
        if CAUSAL or WINDOW_RIGHT:
            end = tl.where(band_is_empty(window_left, window_right, WINDOW_RIGHT), start, end)
        unmasked_end = tl.minimum(tl.maximum(unmasked_end, start), end)
        # A window narrower than the tiles may leave no tile unmasked: then all of [start, end) is masked.
        unmasked_start = tl.minimum(unmasked_start, unmasked_end)
    return start, unmasked_start, unmasked_end, end


@triton.jit
def q_loop_bounds(
    start_n, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query-row ranges of a K/V-stationary program whose keys start at ``start_n`` ->
    ``(lo, unmasked_lo, unmasked_hi, hi)``.

    Q tiles ``[unmasked_lo, unmasked_hi)`` see every key of the block; ``[lo, unmasked_lo)`` need the mask (the causal
    diagonal or the window's right edge, or all tiles when the key block reaches past ``seqlen_k_b``), and so do
    ``[unmasked_hi, hi)`` (later rows that the window's left edge cuts off from the block's first keys).  Rows outside
    ``[lo, hi)`` see none of its keys and are never loaded; ``lo == hi`` when no row does.  Without WINDOW_LEFT,
    ``unmasked_hi == hi`` (the third stage is not compiled).
    """
    diagonal_offset = seqlen_k - seqlen_q
    hi = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL or WINDOW_RIGHT:
        if WINDOW_RIGHT:
            right_diagonal = diagonal_offset + window_right
        else:
            right_diagonal = diagonal_offset
        # Row i sees key j iff i >= j - offset - right: the first row that sees the block's first key ...
        first_row = tl.maximum(start_n - right_diagonal, 0)
        # ... and the first row that sees its last key.
        full_row = tl.maximum(start_n + BLOCK_N - 1 - right_diagonal, 0)
        lo = tl.where(first_row < seqlen_q, (first_row // BLOCK_M) * BLOCK_M, hi)
        unmasked_lo = tl.cdiv(full_row, BLOCK_M) * BLOCK_M
    else:
        lo = hi * 0
        unmasked_lo = hi * 0
    # A key block cut by seqlen_k_b needs the mask on every Q tile; one wholly past it is skipped.
    unmasked_lo = tl.where(start_n + BLOCK_N > seqlen_k_b, hi, unmasked_lo)
    lo = tl.where(start_n >= seqlen_k_b, hi, lo)
    unmasked_lo = tl.minimum(tl.maximum(unmasked_lo, lo), hi)
    unmasked_hi = hi
    if WINDOW_LEFT:
        # Row i sees key j iff i <= j + left - offset: the last row that sees the block's last real key ends the
        # range, and the Q tiles wholly before the last row that sees its first key see all of it.
        left_diagonal = window_left - diagonal_offset
        last_key = tl.minimum(start_n + BLOCK_N, seqlen_k_b) - 1
        rows_end = last_key + left_diagonal + 1  # the rows before it see the block's last real key
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(rows_end, 0), BLOCK_M) * BLOCK_M)
        hi = tl.maximum(hi, lo)
        if CAUSAL or WINDOW_RIGHT:
            # No row both sees a key by the right bound (from first_row on) and by the left one (before rows_end):
            # nothing, not even the tile that lo rounds down to.
            empty = band_is_empty(window_left, window_right, WINDOW_RIGHT) | (rows_end <= first_row)
            hi = tl.where(empty, lo, hi)
        unmasked_hi = (tl.maximum(start_n + left_diagonal + 1, 0) // BLOCK_M) * BLOCK_M
        unmasked_lo = tl.minimum(unmasked_lo, hi)
        unmasked_hi = tl.minimum(tl.maximum(unmasked_hi, unmasked_lo), hi)
    return lo, unmasked_lo, unmasked_hi, hi


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
def tanh_float32(x):
    """``tanh(x)`` to a few float32 ulps everywhere (NaN stays NaN).

    ``1 - 2 / (exp(2 |x|) + 1)`` loses its relative accuracy as ``x -> 0`` (it subtracts from 1 a value near 1:
    ~1e-7 / |x| relative, which a large soft cap turns into score errors of ~1e-7 * cap); below |x| = 0.625 the odd
    minimax polynomial of Cephes' tanhf (S. Moshier) serves instead, relative error ~2e-7.  Both are computed and
    one selected: no divergent branch per element.
    """
    ax = tl.abs(x)
    z = x * x
    poly = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
    small = x + x * (poly - 3.33332819422e-1) * z
    # exp2(2 |x| log2(e)) = exp(2 |x|); overflow to inf gives exactly 1.
    large = 1.0 - 2.0 / (tl.math.exp2(ax * 2.8853900817779268) + 1.0)
    large = tl.where(x < 0, -large, large)
    return tl.where(ax < 0.625, small, large)


@triton.jit
def tanh_approx(x):
    """The hardware's ``tanh.approx.f32`` (one MUFU.TANH, relative error ~2^-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def softcap_tanh_scale(qk_scale, cap_in):
    """``scale / c = qk_scale * cap_in``, the factor of tanh's argument in ``softcap_scores``, held within float32's
    range: a product that overflows (a tiny c under a large scale) would turn a zero score into ``0 * inf = NaN``,
    where scaling and then dividing gave ``tanh(0) = 0``."""
    return tl.minimum(tl.maximum(qk_scale * cap_in, -3.4028234663852886e38), 3.4028234663852886e38)


@triton.jit
def softcap_scores(raw, tanh_scale, cap_out, SOFTCAP: tl.constexpr):
    """The soft cap on raw scores ``q . k`` -> ``(capped, dcap)``: ``capped = c * tanh(s / c) * log2(e)`` (the capped
    score ``s = raw * scale`` in base-2 units) and ``dcap = 1 - tanh(s / c)^2``, the cap's derivative, which
    multiplies dS in the backward (recomputed from the raw score, never stored).  ``tanh_scale = scale / c``
    (``softcap_tanh_scale``: one multiply per score before the tanh, where scaling and then dividing by c took two),
    ``cap_out = c * log2(e)`` (``ScoreModifiers``).

    SOFTCAP == 2: the hardware's ``tanh.approx.f32`` (one MUFU.TANH, relative error ~2^-11), for float16/bfloat16 on
    the GPU, whose P is rounded coarser than that anyway; the exact form (``tanh_float32``) costs an EX2 and a
    division more per score, on the unit the softmax's own EX2 already loads.  SOFTCAP == 1: ``tanh_float32``.
    """
    x = raw * tanh_scale
    if SOFTCAP == 2:
        tanh = tanh_approx(x)
    else:
        tanh = tanh_float32(x)
    return cap_out * tanh, 1.0 - tanh * tanh


@triton.jit
def alibi_scores(s2, q_pos, k_pos, slope2):
    """ALiBi on base-2 scores: ``s2 - slope2 * |i' - j|`` (``slope2 = slope * log2(e)``).

    ``q_pos`` (``i' = i + Nk - Nq``) and ``k_pos`` (``j``) arrive as float32 in the tile's orientation; positions are
    exact in float32 below 2^24, and the distance costs one FADD and one FFMA per score (no integer conversion).
    """
    return s2 - slope2 * tl.abs(q_pos - k_pos)


@triton.jit
def modified_scores(
    raw, qk_scale, q_idx, k_idx, diagonal_offset, cap_in, cap_out, slope2,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    """Base-2 scores of a tile with the score modifiers, from its raw ``q . k`` -> ``(s2, dcap)``.

    ``s2 = raw * qk_scale`` (``qk_scale = scale * log2(e)``), then the soft cap, then ALiBi (SPEC.md's order; the
    masks come after).  ``q_idx``/``k_idx`` are the tile's row and key indices (``[M, 1]`` and ``[1, N]`` or
    transposed); ``dcap`` is the soft cap's derivative (1.0 without SOFTCAP).  Only called with SOFTCAP or ALIBI: the
    plain kernels keep their own (possibly folded) scaling.
    """
    if SOFTCAP:
        s2, dcap = softcap_scores(raw, softcap_tanh_scale(qk_scale, cap_in), cap_out, SOFTCAP)
    else:
        s2, dcap = raw * qk_scale, 1.0
    if ALIBI:
        q_pos = (q_idx + diagonal_offset).to(tl.float32)
        s2 = alibi_scores(s2, q_pos, k_idx.to(tl.float32), slope2)
    return s2, dcap


@triton.jit
def alibi_slope2(alibi_ptr, batch, head, stride_alibi_b, stride_alibi_h, ALIBI: tl.constexpr):
    """``slope[batch, head] * log2(e)`` (the slopes tensor is float32 ``[B, H]``, stride 0 over B for ``[H]``); 0.0
    without ALIBI (never read)."""
    if ALIBI:
        slope = tl.load(alibi_ptr + as_int64(batch) * stride_alibi_b + as_int64(head) * stride_alibi_h)
        slope2 = slope * 1.4426950408889634
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def recompute_p(scores_raw, lse2, qk_scale, visible, MASKED: tl.constexpr):
    """``P = exp(S - lse)`` of one tile from its raw scores, as ``exp2(s * qk_scale - lse2)`` (one FFMA + EX2).

    ``lse2`` comes already broadcast to the tile's orientation (``[M, 1]`` for a ``[M, N]`` tile, ``[1, M]`` for
    the transposed ``[N, M]`` tile of the K/V-stationary kernel).  MASKED: hidden entries give exactly 0.  For scores
    already scaled (the score modifiers), ``qk_scale`` is 1.0 (the multiply folds away).
    """
    p = tl.math.exp2(scores_raw * qk_scale - lse2)
    if MASKED:
        p = tl.where(visible, p, 0.0)
    return p


@triton.jit
def recompute_tile_p(
    scores_raw, lse2, qk_scale, q_idx, k_idx, diagonal_offset, seqlen_k_b, band, modifiers,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """``P`` of one backward tile from its raw scores, with the score modifiers and the mask -> ``(p, dcap)``.

    ``q_idx``/``k_idx`` are the tile's rows and keys in its orientation (``[M, 1]``/``[1, N]``, or ``[1, M]``/``[N, 1]``
    for the K/V-stationary kernel's transposed tiles), ``lse2`` broadcast alike.  ``band = (window_left,
    window_right)``, ``modifiers = (cap_in, cap_out, slope2)``.  ``dcap``: the soft cap's derivative, which the caller
    multiplies into ``dS = P * (dP - Delta)`` (1.0 without SOFTCAP).
    """
    window_left, window_right = band
    cap_in, cap_out, slope2 = modifiers
    visible = None
    if MASKED:
        visible = key_visible(
            q_idx, k_idx, diagonal_offset, seqlen_k_b, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT
        )
    if SOFTCAP or ALIBI:
        s2, dcap = modified_scores(
            scores_raw, qk_scale, q_idx, k_idx, diagonal_offset, cap_in, cap_out, slope2, SOFTCAP, ALIBI
        )
        p = recompute_p(s2, lse2, 1.0, visible, MASKED)
    else:
        dcap = 1.0
        p = recompute_p(scores_raw, lse2, qk_scale, visible, MASKED)
    return p, dcap
