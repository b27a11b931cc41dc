"""FlashAttention-2 backward without atomics: a Q-stationary dQ kernel, then a K/V-stationary dK/dV kernel.

With ``P = exp(S - lse)`` recomputed per tile and ``Delta_i = rowsum(dO_i * O_i)`` (= ``rowsum(dP_i * P_i)``):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Delta),   dQ = scale * dS K,   dK = scale * dS^T Q

``dq_kernel`` runs first: it keeps one Q block (with its dO rows) resident, computes and stores Delta for its rows
from one extra load of O, stores lse in base 2 beside it, and loops over the K/V blocks, writing dQ once.
``dkdv_kernel`` then keeps one K/V block resident and loops over the Q blocks (and, for grouped-query attention, over
the query heads of the group), reading the stored lse2 and Delta, so each dK/dV row is summed in one program and
written once.  No atomics: results are bitwise reproducible.  On Hopper the tuner may run the dK/dV kernel's Gluon
version instead (``backward_gluon.py``, ``gluon`` configs), which sums in the same order: the same bits.  At
D = 256, and at D = 192 with Dv = 128, both kernels have Gluon versions that split the head dim between two
warpgroups (``backward_gluon_wide.py``; dS from P rounded to the input dtype, so not the Triton kernels' bits).

FLOPs: the dK/dV kernel 4 matrix products (S, dP, dV, dK) and the dQ kernel 3 (S, dP, dQ), each 2*Nq*Nk*D per head:
14*B*H*Nq*Nk*D in total, i.e. 3.5x the forward (the usual 2.5x count excludes the recomputation of S and dP
in the second kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from . import compiled_launch, tuning
from .backward_gluon import attention_dkdv_hopper
from .backward_gluon_dq import attention_dq_hopper
from .backward_gluon_wide import attention_dkdv_wide_hopper, attention_dq_wide_hopper
from .common import (
    LOG2E,
    alibi_slope2,
    head_rows,
    kv_block_opening,
    kv_loop_bounds,
    load_kv_tile,
    load_lse2,
    load_rows,
    q_block_opening,
    q_loop_bounds,
    recompute_tile_p,
    row_delta,
    row_stats_offset,
    store_rows,
)
from .gluon_hopper import record_compile_failure
from .launch import KernelVariant, PreparedCall, aligned_value_rows, grid_1d, run, tensor_args


@triton.jit
def _dkdv_stage(
    dk, dv, visited, k_tile, v_tile, q_rows, do_rows, lse2_row_ptr, delta_row_ptr,
    keys, lo, hi, seqlen_q, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, Q_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dK ``[BLOCK_N, D]``, dV ``[BLOCK_N, Dv]`` of the resident K/V block over the Q tiles ``[lo, hi)`` of
    one head (its matrices ``q_rows``/``do_rows``, ``common.head_rows``).

    Works on transposed tiles (``S^T = K Q^T``, ``[BLOCK_N, BLOCK_M]``) so that P^T and dS^T come out of the
    dots already in the layout of the left operand of ``P^T dO`` and ``dS^T Q``.

    Q_TAIL: the last Q tile reaches past ``seqlen_q``; its padding rows load as zeros with lse = +inf, so their
    P is 0 (only the loads are masked).  Without a tail the loads carry no predicate at all: this kernel sits
    at the 255-register limit, and the predicated loads made it spill more and run 1.1-1.2x slower on the
    H100 (docs/design.md).
    """
    local_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + local_m
        q_tile = load_rows(q_rows, start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, Q_TAIL)
        do_tile = load_rows(do_rows, start_m, local_m, cols_v, seqlen_q, head_dim_v, EVEN_DV, Q_TAIL)
        # lse2 arrives in base 2 with the empty-row rule applied (the dQ kernel wrote it): a plain load, no
        # per-tile conversion.  Padding rows get lse2 = +inf, so their P is 0.
        if Q_TAIL:
            lse2 = tl.load(lse2_row_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_row_ptr + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse2 = tl.load(lse2_row_ptr + rows)
            delta = tl.load(delta_row_ptr + rows)
        scores_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=DOT_PRECISION)
        dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=DOT_PRECISION)
        p_t, dcap = recompute_tile_p(
            scores_t, lse2[None, :], qk_scale, rows[None, :], keys[:, None], diagonal_offset, seqlen_k_b, band,
            modifiers, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED,
        )  # fmt: skip
        # dV's product is issued before dS is formed, so the tensor cores run it during dS's arithmetic (the
        # products whose results the loop consumes right away, S^T and dP^T, are waited for at once).
        dv = tl.dot(p_t.to(do_tile.dtype), do_tile, dv, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * dcap
        dk = tl.dot(ds_t.to(q_tile.dtype), q_tile, dk, input_precision=DOT_PRECISION)
        visited += 1
    return dk, dv, visited


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=[
    "head_dim", "num_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "num_n_blocks", "head_dim_v",
    "window_left", "window_right", "stride_alibi_b", "stride_alibi_h", "num_sequences", "search_steps",
])  # fmt: skip
def dkdv_kernel(
    q_ptr, stride_qb, stride_qh, stride_qm, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    v_ptr, stride_vb, stride_vh, stride_vn, stride_vd,
    do_ptr, stride_dob, stride_doh, stride_dom, stride_dod,
    dk_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    dv_ptr, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    lse2_ptr, delta_ptr, seqlens_ptr, counts_ptr,
    num_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, num_n_blocks, sm_scale, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    Q_TAIL: tl.constexpr, MASK_STAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, DEBUG: tl.constexpr,
):  # fmt: skip
    """dK, dV of one K/V block of one (batch, kv head); grid: 1-d, num_n_blocks * B * Hkv programs.

    Each tensor arrives as its pointer and four strides; lse2 and Delta (written by the dQ kernel) are contiguous
    ``[B, H, Nq]``.  For grouped-query attention the program also loops over the ``group_size`` query heads that read
    this K/V head, summing their contributions in registers.
    Q_TAIL: ``seqlen_q`` is not a multiple of BLOCK_M (the streamed Q-side loads need row predicates).
    Up to three stages over the Q tiles (``common.q_loop_bounds``): the tiles on the right edge (causal diagonal,
    window's right bound) or all of them for a block cut by ``seqlens_k`` (MASK_STAGE: some tile may need the mask,
    ``PreparedCall.mask_stage_needed``), the unmasked ones, and the tiles cut by the window's left edge
    (WINDOW_LEFT); a stage that cannot run is not compiled.
    v, do and dv have their own head dim (``head_dim_v``, tile BLOCK_DV); DV_IS_D: it is q's, and dv takes dk's
    strides (both allocated contiguous, so their column strides are both 1), so a call without its own Dv compiles
    as before.
    DEBUG writes (visited, skipped) Q tile counts, summed over the group.
    VARLEN: packed tensors, lse2/Delta ``[H, total_q]``, one key block of one sequence per program
    (``common.kv_block_opening``); keys of a sequence without query rows get zero gradients.
    """
    if DV_IS_D:
        head_dim_v = head_dim
        stride_dvb = stride_dkb
        stride_dvh = stride_dkh
        stride_dvn = stride_dkn
    q = (q_ptr, stride_qb, stride_qh, stride_qm, stride_qd)
    k = (k_ptr, stride_kb, stride_kh, stride_kn, stride_kd)
    v = (v_ptr, stride_vb, stride_vh, stride_vn, stride_vd)
    do = (do_ptr, stride_dob, stride_doh, stride_dom, stride_dod)
    dk_out = (dk_ptr, stride_dkb, stride_dkh, stride_dkn, stride_dkd)
    dv_out = (dv_ptr, stride_dvb, stride_dvh, stride_dvn, stride_dvd)
    pid = tl.program_id(0)
    varlen = (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps)
    total_q = seqlen_q
    batch, kv_head, start_n, q_first, k_first, seqlen_q, seqlen_k, seqlen_k_b = kv_block_opening(
        pid, num_n_blocks, num_kv_heads, seqlens_ptr, seqlen_q, seqlen_k, varlen, BLOCK_N, HAS_SEQLENS, VARLEN
    )
    if VARLEN:  # noqa: SIM102  (a constexpr test first: a dense kernel compiles no check)
        if start_n >= seqlen_k:
            return
    local_n = tl.arange(0, BLOCK_N)
    keys = start_n + local_n
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    k_tile = load_rows(head_rows(k, k_first, kv_head), start_n, local_n, cols, seqlen_k_b, head_dim, EVEN_D, True)
    v_tile = load_rows(head_rows(v, k_first, kv_head), start_n, local_n, cols_v, seqlen_k_b, head_dim_v, EVEN_DV, True)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    visited = tl.zeros([], tl.int32)
    lo, unmasked_lo, unmasked_hi, hi = q_loop_bounds(
        start_n, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    diagonal_offset = seqlen_k - seqlen_q
    band = (window_left, window_right)
    for g in range(0, group_size):
        head = kv_head * group_size + g
        q_rows = head_rows(q, q_first, head)
        do_rows = head_rows(do, q_first, head)
        row_offset = row_stats_offset(batch * num_heads + head, head, q_first, total_q, VARLEN)
        lse2_row_ptr = lse2_ptr + row_offset
        delta_row_ptr = delta_ptr + row_offset
        modifiers = (cap_in, cap_out, alibi_slope2(alibi_ptr, batch, head, stride_alibi_b, stride_alibi_h, ALIBI))
        if MASK_STAGE:
            dk, dv, visited = _dkdv_stage(
                dk, dv, visited, k_tile, v_tile, q_rows, do_rows, lse2_row_ptr, delta_row_ptr,
                keys, lo, unmasked_lo, seqlen_q, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
                modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_M, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                ALIBI, MASKED=True, Q_TAIL=Q_TAIL, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        dk, dv, visited = _dkdv_stage(
            dk, dv, visited, k_tile, v_tile, q_rows, do_rows, lse2_row_ptr, delta_row_ptr,
            keys, unmasked_lo, unmasked_hi, seqlen_q, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v,
            band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_M, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
            ALIBI, MASKED=False, Q_TAIL=Q_TAIL, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        if WINDOW_LEFT:
            dk, dv, visited = _dkdv_stage(
                dk, dv, visited, k_tile, v_tile, q_rows, do_rows, lse2_row_ptr, delta_row_ptr,
                keys, unmasked_hi, hi, seqlen_q, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
                modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_M, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                ALIBI, MASKED=True, Q_TAIL=Q_TAIL, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip

    store_rows(head_rows(dk_out, k_first, kv_head), dk * sm_scale, start_n, local_n, cols, seqlen_k, head_dim, EVEN_D)
    store_rows(head_rows(dv_out, k_first, kv_head), dv, start_n, local_n, cols_v, seqlen_k, head_dim_v, EVEN_DV)
    if DEBUG:
        total = tl.cdiv(seqlen_q, BLOCK_M) * group_size
        tl.store(counts_ptr + pid * 2, visited)
        tl.store(counts_ptr + pid * 2 + 1, total - visited)


@triton.jit
def _dq_stage(
    dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
    rows, lo, hi, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate (unscaled) dQ ``[BLOCK_M, D]`` of the resident Q block over the K/V tiles ``[lo, hi)`` of the
    matrices ``k_rows``/``v_rows``.

    USE_TMA: load K/V through the descriptors ``k_desc``/``v_desc`` (``common.load_kv_tile``); unmasked tiles only.
    """
    local_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + local_n
        k_tile = load_kv_tile(
            k_rows, k_desc, batch, kv_head, start_n, local_n, cols, seqlen_k_b, head_dim,
            EVEN_D, MASKED, USE_TMA, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        v_tile = load_kv_tile(
            v_rows, v_desc, batch, kv_head, start_n, local_n, cols_v, seqlen_k_b, head_dim_v,
            EVEN_DV, MASKED, USE_TMA, BLOCK_N, BLOCK_DV,
        )  # fmt: skip
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        p, dcap = recompute_tile_p(
            scores, lse2[:, None], qk_scale, rows[:, None], keys[None, :], diagonal_offset, seqlen_k_b, band,
            modifiers, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED,
        )  # fmt: skip
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap
        dq = tl.dot(ds.to(k_tile.dtype), k_tile, dq, input_precision=DOT_PRECISION)
        visited += 1
    return dq, visited


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=[
    "head_dim", "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "head_dim_v", "window_left",
    "window_right", "stride_alibi_b", "stride_alibi_h", "num_sequences", "search_steps",
])  # fmt: skip
def dq_kernel(
    q_ptr, stride_qb, stride_qh, stride_qm, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    v_ptr, stride_vb, stride_vh, stride_vn, stride_vd,
    o_ptr, stride_ob, stride_oh, stride_om, stride_od,
    do_ptr, stride_dob, stride_doh, stride_dom, stride_dod,
    dq_ptr, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    lse_ptr, lse2_ptr, delta_ptr, k_desc, v_desc, seqlens_ptr, counts_ptr,
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, sm_scale, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    MASK_STAGE: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DEBUG: tl.constexpr,
):  # fmt: skip
    """dQ (and Delta, lse2) of one Q block of one (batch, head); grid: 1-d, num_m_blocks * B * H programs.

    Each tensor arrives as its pointer and four strides; lse (read), lse2 and Delta (written for the dK/dV kernel)
    are contiguous ``[B, H, Nq]``.  The K/V stages are the forward's (``common.kv_loop_bounds``): the window's left
    edge (WINDOW_LEFT), the unmasked tiles, the right edge or padding (MASK_STAGE).  o and do have v's head dim
    (``head_dim_v``, tile BLOCK_DV; DV_IS_D: q's, read from ``head_dim``).
    USE_TMA: the unmasked stage loads K/V through the descriptors ``k_desc``/``v_desc`` (box ``[BLOCK_N, BLOCK_D]``).
    VARLEN: packed tensors, lse/lse2/Delta ``[H, total_q]``, one block of one sequence per program (as the forward).
    """
    if DV_IS_D:
        head_dim_v = head_dim
    q = (q_ptr, stride_qb, stride_qh, stride_qm, stride_qd)
    k = (k_ptr, stride_kb, stride_kh, stride_kn, stride_kd)
    v = (v_ptr, stride_vb, stride_vh, stride_vn, stride_vd)
    o = (o_ptr, stride_ob, stride_oh, stride_om, stride_od)
    do = (do_ptr, stride_dob, stride_doh, stride_dom, stride_dod)
    dq_out = (dq_ptr, stride_dqb, stride_dqh, stride_dqm, stride_dqd)
    varlen = (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps)
    total_q = seqlen_q
    bh, m_block, batch, head, kv_head, start_m, q_first, k_first, seqlen_q, seqlen_k, seqlen_k_b = q_block_opening(
        tl.program_id(0), num_m_blocks, num_heads, group_size, seqlens_ptr, seqlen_q, seqlen_k, varlen,
        BLOCK_M, CAUSAL, HAS_SEQLENS, VARLEN,
    )  # fmt: skip
    if VARLEN:  # noqa: SIM102  (a constexpr test first: a dense kernel compiles no check)
        if start_m >= seqlen_q:
            return
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    k_rows = head_rows(k, k_first, kv_head)
    v_rows = head_rows(v, k_first, kv_head)
    q_tile = load_rows(head_rows(q, q_first, head), start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, True)
    do_tile = load_rows(head_rows(do, q_first, head), start_m, local_m, cols_v, seqlen_q, head_dim_v, EVEN_DV, True)
    # Delta_i = rowsum(dO_i * O_i), from the dO tile already resident: one more [BLOCK_M, Dv] load per program
    # instead of a separate pass over O and dO.  Stored for the dK/dV kernel, which runs after this one.
    o_tile = load_rows(head_rows(o, q_first, head), start_m, local_m, cols_v, seqlen_q, head_dim_v, EVEN_DV, True)
    delta = row_delta(o_tile, do_tile)
    row_offset = row_stats_offset(bh, head, q_first, total_q, VARLEN)
    tl.store(delta_ptr + row_offset + rows, delta, mask=rows < seqlen_q)
    lse2 = load_lse2(lse_ptr + row_offset + rows, rows, seqlen_q, True)
    tl.store(lse2_ptr + row_offset + rows, lse2, mask=rows < seqlen_q)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.zeros([], tl.int32)
    start, unmasked_start, unmasked_end, end = kv_loop_bounds(
        start_m, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    diagonal_offset = seqlen_k - seqlen_q
    band = (window_left, window_right)
    modifiers = (cap_in, cap_out, alibi_slope2(alibi_ptr, batch, head, stride_alibi_b, stride_alibi_h, ALIBI))
    if WINDOW_LEFT:
        dq, visited = _dq_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
            rows, start, unmasked_start, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
            MASKED=True, USE_TMA=False, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    dq, visited = _dq_stage(
        dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
        rows, unmasked_start, unmasked_end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
        modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
        MASKED=False, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    if MASK_STAGE:
        dq, visited = _dq_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
            rows, unmasked_end, end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
            MASKED=True, USE_TMA=False, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    store_rows(head_rows(dq_out, q_first, head), dq * sm_scale, start_m, local_m, cols, seqlen_q, head_dim, EVEN_D)
    if DEBUG:
        program = bh * num_m_blocks + m_block
        total = tl.cdiv(seqlen_k, BLOCK_N)
        tl.store(counts_ptr + program * 2, visited)
        tl.store(counts_ptr + program * 2 + 1, total - visited)


def attention_backward_2kernel(
    call: PreparedCall, do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``[B, H, Nq, D]``, dk ``[B, Hkv, Nk, D]``, dv ``[B, Hkv, Nk, Dv]`` (dtype of q; dk/dv summed over each head
    group); ``do``, ``o``: ``[B, H, Nq, Dv]``.  Packed (``call.varlen``): the packed shapes, lse ``[H, total_q]``."""
    q, k, v = call.q, call.k, call.v
    H, Hkv, D = call.problem.heads, call.problem.kv_heads, call.problem.head_dim
    Nq, Nk = call.seqlen_q, call.seqlen_k  # packed: total_q, total_k
    lse = lse.contiguous()
    do, o = aligned_value_rows(do, call), aligned_value_rows(o, call)
    # Per-row statistics for the dK/dV kernel, written by the dQ kernel: lse in base 2, and Delta.
    lse2 = call.new_output(call.row_stats_shape, torch.float32)
    delta = call.new_output(call.row_stats_shape, torch.float32)
    dq = call.new_output(q.shape, q.dtype)
    dk = call.new_output(k.shape, q.dtype)
    dv = call.new_output(v.shape, q.dtype)
    qk_scale = call.scale * LOG2E
    hopper_dkdv = not call.gluon_reasons(KernelVariant.DKDV, do)
    hopper_dq = not call.gluon_reasons(KernelVariant.DQ, do, o)
    modifiers = call.modifiers
    launch_key = call.launch_key(do, o, lse)

    def gluon_runs(cfg, kernel: str) -> bool:
        # Above D = 128 the Gluon kernels are backward_gluon_wide's, of one tile: another pinned gluon config runs
        # its Triton twin, as a gluon config outside the scope does (the tuner never offers one, fits_head_dim).
        return cfg.gluon and (call.problem.head_dim <= 128 or tuning.fits_head_dim(kernel, cfg, call.block_d))

    def launch_dkdv(cfg) -> None:
        if hopper_dkdv and gluon_runs(cfg, "dkdv"):
            try:
                if call.problem.head_dim > 128:  # (the scope: backward_gluon_wide's head dims)
                    attention_dkdv_wide_hopper(
                        q, k, v, do, lse2, delta, dk, dv, call.scale, call.causal, cfg.block_m, cfg.block_n,
                        cfg.num_stages, modifiers, varlen=call.varlen_args if call.varlen else None,
                        launch_key=launch_key,
                    )  # fmt: skip
                    return
                attention_dkdv_hopper(
                    q, k, v, do, lse2, delta, dk, dv, call.scale, call.causal, modifiers,
                    cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                    varlen=call.varlen_args if call.varlen else None, launch_key=launch_key,
                )  # fmt: skip
                return
            except CompilationError as error:  # Gluon's API drifted (frontend error): the Triton kernel's tiles serve
                record_compile_failure(error)
        num_n_blocks = call.kv_slots(cfg.block_n)
        programs = call.kv_programs(cfg.block_n)
        compiled_launch.launch(
            dkdv_kernel, grid_1d(programs), launch_key,
            *tensor_args(q), *tensor_args(k), *tensor_args(v), *tensor_args(do), *tensor_args(dk), *tensor_args(dv),
            lse2, delta, call.seqlens, call.counts_for(KernelVariant.DKDV, programs),
            H, Hkv, call.group_size, Nq, Nk, num_n_blocks, call.scale, qk_scale, D, *modifiers.args,
            *call.varlen_args, VARLEN=call.varlen,
            EVEN_D=call.even_d, BLOCK_D=call.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=call.causal, HAS_SEQLENS=call.has_seqlens, Q_TAIL=call.varlen or Nq % cfg.block_m != 0,
            MASK_STAGE=call.mask_stage_needed(cfg.block_n), DOT_PRECISION=call.dot_precision, DEBUG=call.debug,
            **modifiers.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def launch_dq(cfg) -> None:
        if hopper_dq and gluon_runs(cfg, "dq"):
            try:
                if call.problem.head_dim > 128:  # (as in launch_dkdv)
                    attention_dq_wide_hopper(
                        q, k, v, o, do, lse, lse2, delta, dq, call.scale, call.causal, cfg.block_m, cfg.block_n,
                        cfg.num_stages, modifiers, varlen=call.varlen_args if call.varlen else None,
                        launch_key=launch_key,
                    )  # fmt: skip
                    return
                attention_dq_hopper(
                    q, k, v, o, do, lse, lse2, delta, dq, call.scale, call.causal, modifiers,
                    cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                    varlen=call.varlen_args if call.varlen else None, launch_key=launch_key,
                )  # fmt: skip
                return
            except CompilationError as error:  # as in launch_dkdv
                record_compile_failure(error)
        num_m_blocks = call.q_slots(cfg.block_m)
        use_tma, k_desc, v_desc = call.kv_tile_descriptors(cfg)
        programs = call.q_programs(cfg.block_m)
        compiled_launch.launch(
            dq_kernel, grid_1d(programs), launch_key,
            *tensor_args(q), *tensor_args(k), *tensor_args(v), *tensor_args(o), *tensor_args(do), *tensor_args(dq),
            lse, lse2, delta, k_desc, v_desc, call.seqlens, call.counts_for(KernelVariant.DQ, programs),
            H, call.group_size, Nq, Nk, num_m_blocks, call.scale, qk_scale, D, *modifiers.args,
            *call.varlen_args, VARLEN=call.varlen,
            EVEN_D=call.even_d, BLOCK_D=call.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=call.causal, HAS_SEQLENS=call.has_seqlens, MASK_STAGE=call.mask_stage_needed(cfg.block_n),
            USE_TMA=use_tma, DOT_PRECISION=call.dot_precision, DEBUG=call.debug, **modifiers.flags,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    run(call, KernelVariant.DQ, launch_dq, gluon_in_scope=hopper_dq)  # first: it writes lse2 and Delta
    run(call, KernelVariant.DKDV, launch_dkdv, gluon_in_scope=hopper_dkdv)
    return dq, dk, dv
