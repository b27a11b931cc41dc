"""Flash-decoding (split-K) forward in Triton: the ``triton_splitk`` backend's kernels.

Decoding asks for a few query rows against thousands of keys.  A Q-stationary kernel launches one program per
(Q block, batch, head), B * H programs for Nq = 1, and at B = 1 leaves most of the H100's 132 SMs idle while a few
stream the whole cache.  Here the keys of each (batch, K/V head) are cut into ``num_splits`` contiguous ranges, one
program each; every program writes the attention of its rows over its range, a partial ``(o_s, lse_s)``, and a
second small kernel merges the partials by their log-sum-exp (``attnzoo/merge.py`` has the formula):

    lse = log sum_s exp(lse_s)          o = sum_s exp(lse_s - lse) o_s

Two more choices serve decoding:

- The query heads of one grouped-query group are packed into the rows of one tile: row ``r`` of a (batch, K/V head)
  is query row ``i = r // G`` of query head ``kv_head * G + r % G``.  Each K/V tile is loaded once for the whole
  group instead of once per query head (G = 4 with H = 32, Hkv = 8), and the tile's rows are G * Nq rather than a
  mostly empty block of Nq.  Rows are query-major so that a tile of rows covers a contiguous range of query
  positions, which keeps the causal/window key bounds tight when Nq is large.
- Paged caches are read through the block table directly: key ``t`` of sequence ``b`` lives in physical page
  ``block_table[b, t // page_size]`` at slot ``t % page_size``.  A dense cache is the same gather with the batch as
  the page and no block table, so one kernel serves both.  Row offsets are int64 (a 128k-key cache of 64 sequences
  holds more than 2^31 elements).

Masks follow SPEC.md with the query position aligned bottom-right to the attended length of each sequence
(ALIGN_TO_LENGTH, the KV-cache call: ``i' = i + L_b - Nq``) or to Nk (the plain forward: ``i' = i + Nk - Nq``).
A split whose keys no row sees writes ``o = 0``, ``lse = -inf``; the merge gives such parts no weight.

Bytes: the K and V rows up to each sequence's length, read once per (batch, K/V head); the partials add
``num_splits * B * H * Nq * (Dv + 1) * 4`` bytes written and read again, small beside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compiled_launch
from .common import LOG2E, as_int64, key_visible, modified_scores, online_softmax_step
from .launch import ScoreModifiers, _placeholder, dot_precision, num_blocks, sm_count
from .tuning import head_dim_tile

# Programs per SM the split count aims for: enough resident programs to keep each SM's loads in flight while
# others wait on memory, few enough that the partials stay small.
PROGRAMS_PER_SM = 4
# A split reads at least this many keys: below it the partial's write and merge cost more than the split saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 256


@triton.jit
def _key_slots(
    start_n, keys, key_ok, batch, block_table_ptr, stride_bt_b, stride_bt_p, page_size,
    PAGED: tl.constexpr, PAGE_HOLDS_TILES: tl.constexpr,
):  # fmt: skip
    """Where keys ``keys`` (the tile from ``start_n``) of sequence ``batch`` live -> int64 ``(page, slot)``: PAGED,
    page ``block_table[batch, t // page_size]`` and slot ``t % page_size`` of a cache ``[pages, Hkv, page_size, D]``;
    dense, the batch as the page and the key as its slot of ``[B, Hkv, N, D]``.

    PAGE_HOLDS_TILES (the page size a multiple of BLOCK_N): the tile lies in one page, whose entry is read once, as a
    scalar, and its rows are consecutive slots; otherwise each key reads its own entry, and keys that are not
    ``key_ok`` (their loads are masked) read none."""
    if PAGED and PAGE_HOLDS_TILES:
        page = tl.load(block_table_ptr + as_int64(batch) * stride_bt_b + (start_n // page_size) * stride_bt_p)
        page = page.to(tl.int64)
        slot = (start_n % page_size + (keys - start_n)).to(tl.int64)
    elif PAGED:
        page = tl.load(
            block_table_ptr + as_int64(batch) * stride_bt_b + (keys // page_size) * stride_bt_p, mask=key_ok, other=0
        ).to(tl.int64)
        slot = (keys % page_size).to(tl.int64)
    else:
        page = as_int64(batch)
        slot = keys.to(tl.int64)
    return page, slot


@triton.jit
def _rows_and_cols(row_ok, cols, head_dim, EVEN: tl.constexpr):
    """The mask of a ``[rows, BLOCK_D]`` tile: rows ``row_ok``, columns below ``head_dim``.  EVEN (the head dim fills
    the tile): the row test alone, constant along a row, which keeps loads and stores 16-byte vectors (a column test
    against the runtime head dim splits them into 2-byte accesses; ``common.tile_in_bounds``)."""
    if EVEN:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (cols[None, :] < head_dim)
    return mask


@triton.jit(do_not_specialize=[
    "seqlen_q", "seqlen_k", "num_kv_heads", "group_size", "page_size", "keys_per_split", "head_dim", "head_dim_v",
    "window_left", "window_right", "stride_alibi_b", "stride_alibi_h",
])  # fmt: skip
def splitk_partial_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, block_table_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kp, stride_kh, stride_ks, stride_kd,
    stride_vp, stride_vh, stride_vs, stride_vd,
    stride_bt_b, stride_bt_p,
    stride_ob, stride_oh, stride_om, stride_osplit, stride_od,
    stride_lb, stride_lh, stride_lm, stride_lsplit,
    seqlen_q, seqlen_k, num_kv_heads, group_size, page_size, keys_per_split, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    ALIGN_TO_LENGTH: tl.constexpr, PAGED: tl.constexpr, PAGE_HOLDS_TILES: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FINAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The attention of one tile of packed rows of one (batch, K/V head) over the keys of one split.

    Grid ``(B * Hkv, num_splits, row tiles)``.  FINAL (one split): ``o`` normalised in the output dtype into
    ``o_ptr`` ``[B, H, Nq, Dv]`` and ``lse`` into ``[B, H, Nq]`` (the split strides are unused); otherwise float32
    partials into ``[B, H, Nq, splits, Dv]`` and ``[B, H, Nq, splits]``.
    """
    if DV_IS_D:
        head_dim_v = head_dim
    batch_kv = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = tl.program_id(2)
    batch = batch_kv // num_kv_heads
    kv_head = batch_kv % num_kv_heads
    if HAS_LENGTHS:
        length = tl.load(lengths_ptr + batch).to(tl.int32)
    else:
        length = seqlen_k + tl.zeros([], tl.int32)
    # Query row i sits at key position i' = i + diagonal_offset (bottom-right alignment).
    if ALIGN_TO_LENGTH:
        diagonal_offset = length - seqlen_q
    else:
        diagonal_offset = seqlen_k - seqlen_q

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen_q * group_size
    q_idx = rows // group_size
    head = kv_head * group_size + rows % group_size
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    q_rows = as_int64(batch) * stride_qb + head.to(tl.int64) * stride_qh + q_idx.to(tl.int64) * stride_qm
    q_tile = tl.load(
        q_ptr + q_rows[:, None] + cols[None, :] * stride_qd,
        mask=_rows_and_cols(row_ok, cols, head_dim, EVEN_D),
        other=0.0,
    )
    if ALIBI:
        slope = tl.load(
            alibi_ptr + as_int64(batch) * stride_alibi_b + head.to(tl.int64) * stride_alibi_h, mask=row_ok, other=0.0
        )
        slope2 = (slope * 1.4426950408889634)[:, None]
    else:
        slope2 = 0.0

    # The keys of this split that some row of the tile may see: the split's range, cut at the length, at the
    # right edge of the band (causal: j <= i' (+ right)) for the tile's last query row and at its left edge
    # (j >= i' - left) for its first.  Tiles start at multiples of BLOCK_N (keys_per_split is one), so no tile
    # reaches into the next split.
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, length)
    first_q = (row_tile * BLOCK_M) // group_size
    last_q = tl.minimum((row_tile * BLOCK_M + BLOCK_M - 1) // group_size, seqlen_q - 1)
    if CAUSAL or WINDOW_RIGHT:
        if WINDOW_RIGHT:
            right = window_right
        else:
            right = 0
        end = tl.minimum(end, last_q + diagonal_offset + right + 1)
    if WINDOW_LEFT:
        first_key = first_q + diagonal_offset - window_left
        start = tl.maximum(start, (tl.maximum(first_key, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_head = k_ptr + as_int64(kv_head) * stride_kh
    v_head = v_ptr + as_int64(kv_head) * stride_vh
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        # Keys past the length are never read: whatever the cache holds there (stale or NaN) stays out of P @ V.
        key_ok = keys < length
        page, slot = _key_slots(
            start_n, keys, key_ok, batch, block_table_ptr, stride_bt_b, stride_bt_p, page_size, PAGED, PAGE_HOLDS_TILES
        )
        k_rows = page * stride_kp + slot * stride_ks
        k_tile = tl.load(
            k_head + k_rows[:, None] + cols[None, :] * stride_kd,
            mask=_rows_and_cols(key_ok, cols, head_dim, EVEN_D),
            other=0.0,
        )
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        if SOFTCAP or ALIBI:
            qk, _dcap = modified_scores(
                qk, qk_scale, q_idx[:, None], keys[None, :], diagonal_offset, cap_in, cap_out, slope2, SOFTCAP, ALIBI
            )
        else:
            qk = qk * qk_scale
        visible = key_visible(
            q_idx[:, None], keys[None, :], diagonal_offset, length, window_left, window_right,
            CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        )  # fmt: skip
        qk = tl.where(visible, qk, float("-inf"))
        v_rows = page * stride_vp + slot * stride_vs
        v_mask = _rows_and_cols(key_ok, cols_v, head_dim_v, EVEN_DV)
        v_tile = tl.load(v_head + v_rows[:, None] + cols_v[None, :] * stride_vd, mask=v_mask, other=0.0)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, 1.0, v_tile, True, DOT_PRECISION)

    # A row that saw no key in this split (l = 0): o = 0, lse = -inf, which the merge weighs 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_tile = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_rows = as_int64(batch) * stride_ob + head.to(tl.int64) * stride_oh + q_idx.to(tl.int64) * stride_om
    lse_rows = as_int64(batch) * stride_lb + head.to(tl.int64) * stride_lh + q_idx.to(tl.int64) * stride_lm
    if not FINAL:
        o_rows += as_int64(split) * stride_osplit
        lse_rows += as_int64(split) * stride_lsplit
    tl.store(
        o_ptr + o_rows[:, None] + cols_v[None, :] * stride_od, o_tile.to(o_ptr.dtype.element_ty),
        mask=_rows_and_cols(row_ok, cols_v, head_dim_v, EVEN_DV),
    )  # fmt: skip
    tl.store(lse_ptr + lse_rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "head_dim_v"])
def splitk_merge_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, num_splits, head_dim_v,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Merge the ``num_splits`` partials of one row: ``o_part`` float32 ``[rows, splits, Dv]``, ``lse_part``
    ``[rows, splits]`` -> ``o`` ``[rows, Dv]`` (output dtype), ``lse`` ``[rows]``, all contiguous; one program per
    row of ``B * H * Nq``.

    The sum runs relative to the largest part's lse so that no exp overflows; a part with lse = -inf (no key seen)
    weighs exactly 0, and a row empty in every part keeps o = 0, lse = -inf.  A NaN part makes its weight NaN, which
    reaches o and lse.
    """
    row = as_int64(tl.program_id(0))
    splits = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_DV)
    split_ok = splits < num_splits
    lse_s = tl.load(lse_part_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2((lse_s - lse_ref) * 1.4426950408889634)
    total = tl.sum(weight, 0)
    o_s = tl.load(
        o_part_ptr + (row * num_splits + splits[:, None]) * head_dim_v + cols[None, :],
        mask=split_ok[:, None] & (cols[None, :] < head_dim_v),
        other=0.0,
    )
    # A part that saw no key has weight 0 and is left out entirely (0 * o_s would be 0 anyway: its o_s is 0).
    o = tl.sum(tl.where(weight[:, None] != 0.0, weight[:, None] * o_s, 0.0), 0)
    o = o / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + row * head_dim_v + cols, o.to(o_ptr.dtype.element_ty), mask=cols < head_dim_v)
    tl.store(lse_ptr + row, lse_ref + tl.math.log2(total) * 0.6931471805599453)


def choose_num_splits(programs: int, capacity: int, sm_count: int) -> int:
    """How many key ranges each (batch, K/V head, row tile) is cut into: enough that ``programs * splits`` fills the
    GPU ``PROGRAMS_PER_SM`` times over, no split shorter than ``MIN_KEYS_PER_SPLIT`` keys of the cache's
    ``capacity`` (its length for a dense cache, pages * page size for a paged one), at most ``MAX_SPLITS``.

    The capacity, not the per-sequence lengths, decides: the lengths live on the GPU and reading them would cost a
    synchronisation per call (and break CUDA-graph capture).  Splits past a sequence's length exit at once.
    """
    wanted = num_blocks(PROGRAMS_PER_SM * sm_count, max(programs, 1))
    longest = max(1, capacity // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, longest, MAX_SPLITS))


def splitk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem,
    *,
    lengths: torch.Tensor | None,
    block_table: torch.Tensor | None,
    align_to_length: bool,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    new_output=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K attention -> ``o`` ``[B, H, Nq, Dv]`` (dtype of q), ``lse`` ``[B, H, Nq]`` float32.

    q: ``[B, H, Nq, D]``.  Dense (``block_table`` None): k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]``.  Paged: k
    ``[pages, Hkv, page_size, D]``, v ``[pages, Hkv, page_size, Dv]``, ``block_table`` int32 ``[B, max_pages]``.
    ``lengths``: int32 ``[B]`` keys per sequence (None: all ``problem.seqlen_k``).  ``align_to_length``: causal,
    window and ALiBi positions align to each sequence's length (the KV-cache call) rather than to
    ``problem.seqlen_k`` (the plain forward, where lengths are ``seqlens_k``).  ``problem``: the validated
    :class:`attnzoo.Problem` (``seqlen_k``: Nk, or the paged capacity).  ``num_splits`` None: chosen by
    :func:`choose_num_splits`.  ``new_output(shape, dtype)``: the output allocator (NaN-poisoned under the tests).
    """
    B, H, Nq, D = q.shape
    Hkv = problem.kv_heads
    G = H // Hkv
    Dv = problem.head_dim_v
    device = q.device
    paged = block_table is not None
    capacity = problem.seqlen_k
    block_d, block_dv = head_dim_tile(D), head_dim_tile(Dv)
    block_m = min(64, max(16, triton.next_power_of_2(G * Nq)))
    row_tiles = num_blocks(G * Nq, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(B * Hkv * row_tiles, capacity, sm_count(device))
    # Whole tiles per split, so that no tile straddles two splits; trailing splits that would start past the
    # capacity are dropped.
    keys_per_split = max(1, num_blocks(num_blocks(capacity, num_splits), block_n)) * block_n
    num_splits = max(1, num_blocks(capacity, keys_per_split))
    modifiers = ScoreModifiers.of(problem, device, block_d, block_dv)
    placeholder = _placeholder(device)
    lengths_arg = lengths if lengths is not None else placeholder
    table = block_table if paged else placeholder
    stride_bt = block_table.stride() if paged else (0, 0)
    page_size = k.shape[2] if paged else 1
    o = new_output((B, H, Nq, Dv), q.dtype)
    lse = new_output((B, H, Nq), torch.float32)
    final = num_splits == 1
    if final:
        o_part, lse_part = o, lse
        o_strides = (*o.stride()[:3], 0, o.stride(3))
        lse_strides = (*lse.stride(), 0)
    else:
        o_part = new_output((B, H, Nq, num_splits, Dv), torch.float32)
        lse_part = new_output((B, H, Nq, num_splits), torch.float32)
        o_strides, lse_strides = o_part.stride(), lse_part.stride()
    grid = (B * Hkv, num_splits, row_tiles)
    compiled_launch.launch(
        splitk_partial_kernel, grid, None, q, k, v, lengths_arg, table, o_part, lse_part,
        *q.stride(), *k.stride(), *v.stride(), *stride_bt, *o_strides, *lse_strides,
        Nq, capacity, Hkv, G, page_size, keys_per_split, problem.scale * LOG2E, D, *modifiers.args,
        EVEN_D=block_d == D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=problem.causal,
        HAS_LENGTHS=lengths is not None, ALIGN_TO_LENGTH=align_to_length, PAGED=paged,
        PAGE_HOLDS_TILES=paged and page_size % block_n == 0, FINAL=final,
        DOT_PRECISION=dot_precision(problem.dtype), **modifiers.flags, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not final:
        compiled_launch.launch(
            splitk_merge_kernel, (B * H * Nq,), None, o_part, lse_part, o, lse, num_splits, Dv,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_DV=block_dv, num_warps=4 if block_dv >= 128 else 2,
        )  # fmt: skip
    return o, lse
