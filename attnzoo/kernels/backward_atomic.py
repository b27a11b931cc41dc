"""Q-stationary backward whose dK/dV contributions go through ``tl.atomic_add`` (the ``triton_atomic`` backend).

One program per (Q block, batch*head).  It first obtains ``D_i = rowsum(dP_i * P_i)`` for its rows, either

- ``delta="recompute"``: a first pass over the same K/V tiles recomputing P and dP (the original design:
  two extra matrix products per tile, no extra kernel), or
- ``delta="preprocess"``: ``rowsum(dO * O)`` from a preprocess kernel (one pass over O and dO),

then loops over the K/V tiles once more: P from the saved LSE, ``dS = P * (dP - D)``, dQ accumulated in
registers and written once, and the tile's dK/dV contributions added into float32 buffers ``[B, Hkv, Nk, D]``
with atomics.  Query heads of a group add into the same K/V rows, so the group sum comes for free.  The float32
sums are cast to the input dtype at the end.  The order of the atomic additions varies from run to run, so
dK/dV are not bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._env import triton_interpreter_active
from .common import (
    LOG2E,
    alibi_slope2,
    as_int64,
    batch_seqlen_k,
    head_pointer,
    kv_loop_bounds,
    load_lse2,
    load_tile,
    q_block_program,
    recompute_tile_p,
    row_delta,
    store_tile,
    tile_in_bounds,
    tile_pointers,
)
from .launch import KernelVariant, PreparedCall, _placeholder, grid_1d, int32_addressable, num_blocks, run
from .tuning import INTERPRETER_CONFIG

DELTA_MODES = ("recompute", "preprocess")
PREPROCESS_BLOCK_M = 64


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=["head_dim", "num_heads", "seqlen_q", "num_m_blocks"])
def delta_preprocess_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    num_heads,
    seqlen_q,
    num_m_blocks,
    head_dim,
    EVEN_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]`` in float32; delta is contiguous ``[B, H, Nq]``.

    (``head_dim``/BLOCK_D are those of o and do: v's head dim.)
    """
    pid = tl.program_id(0)
    bh = pid // num_m_blocks
    start_m = (pid % num_m_blocks) * BLOCK_M
    batch = bh // num_heads
    head = bh % num_heads
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    cols = tl.arange(0, BLOCK_D)
    o_head = head_pointer(o_ptr, batch, head, stride_ob, stride_oh)
    do_head = head_pointer(do_ptr, batch, head, stride_dob, stride_doh)
    o_tile = load_tile(
        tile_pointers(o_head, start_m, local_m, cols, stride_om, stride_od), rows, seqlen_q, cols,
        head_dim, EVEN_D, True,
    )  # fmt: skip
    do_tile = load_tile(
        tile_pointers(do_head, start_m, local_m, cols, stride_dom, stride_dod), rows, seqlen_q, cols,
        head_dim, EVEN_D, True,
    )  # fmt: skip
    delta = row_delta(o_tile, do_tile)
    tl.store(delta_ptr + as_int64(bh) * seqlen_q + rows, delta, mask=rows < seqlen_q)


def compute_delta(call: PreparedCall, o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``Delta = rowsum(dO * O)`` -> float32 ``[B, H, Nq]`` (one pass over O and dO instead of over K/V).

    (The two-kernel backward computes the same sum inside its dQ kernel instead.)
    """
    B, H, Nq, Dv = o.shape
    delta = call.new_output((B, H, Nq), torch.float32)
    block_m = INTERPRETER_CONFIG.block_m if triton_interpreter_active() else PREPROCESS_BLOCK_M
    num_m_blocks = num_blocks(Nq, block_m)
    delta_preprocess_kernel[grid_1d(num_m_blocks * B * H)](
        o, do, delta, *o.stride(), *do.stride(), H, Nq, num_m_blocks,
        head_dim=Dv, EVEN_D=call.modifiers.flags["EVEN_DV"], BLOCK_D=call.block_dv, BLOCK_M=block_m, num_warps=4,
    )  # fmt: skip
    return delta


@triton.jit
def _delta_recompute_stage(
    delta, q_tile, do_tile, lse2, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
    rows, lo, hi, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate ``rowsum(P * dP)`` over the K/V tiles ``[lo, hi)`` (no soft-cap derivative: Delta is
    ``rowsum(dO * O)``)."""
    local_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + local_n
        k_tile = load_tile(
            tile_pointers(k_head, start_n, local_n, cols, stride_kn, stride_kd), keys, seqlen_k_b, cols,
            head_dim, EVEN_D, MASKED,
        )  # fmt: skip
        v_tile = load_tile(
            tile_pointers(v_head, start_n, local_n, cols_v, stride_vn, stride_vd), keys, seqlen_k_b, cols_v,
            head_dim_v, EVEN_DV, MASKED,
        )  # fmt: skip
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        p, _dcap = recompute_tile_p(
            scores, lse2[:, None], qk_scale, rows[:, None], keys[None, :], diagonal_offset, seqlen_k_b, band,
            modifiers, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED,
        )  # fmt: skip
        delta += tl.sum(p * dp, 1)
    return delta


@triton.jit
def _atomic_stage(
    dq, visited, q_tile, do_tile, lse2, delta, k_head, v_head, dk_head, dv_head,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_accn, stride_dv_accn, rows, lo, hi, diagonal_offset,
    seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ in registers, dK/dV contributions of every K/V tile in ``[lo, hi)`` added atomically."""
    local_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + local_n
        k_tile = load_tile(
            tile_pointers(k_head, start_n, local_n, cols, stride_kn, stride_kd), keys, seqlen_k_b, cols,
            head_dim, EVEN_D, MASKED,
        )  # fmt: skip
        v_tile = load_tile(
            tile_pointers(v_head, start_n, local_n, cols_v, stride_vn, stride_vd), keys, seqlen_k_b, cols_v,
            head_dim_v, EVEN_DV, MASKED,
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
        dv_part = tl.dot(tl.trans(p.to(do_tile.dtype)), do_tile, input_precision=DOT_PRECISION)
        dk_part = tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile, input_precision=DOT_PRECISION) * sm_scale
        # The float32 accumulators are contiguous [B, Hkv, Nk, D] and [B, Hkv, Nk, Dv]; rows past Nk do not exist.
        offsets = as_int64(start_n) * stride_accn + local_n[:, None] * stride_accn + cols[None, :]
        dv_offsets = as_int64(start_n) * stride_dv_accn + local_n[:, None] * stride_dv_accn + cols_v[None, :]
        tl.atomic_add(
            dv_head + dv_offsets, dv_part, mask=tile_in_bounds(keys, seqlen_k, cols_v, head_dim_v, EVEN_DV),
            sem="relaxed",
        )  # fmt: skip
        tl.atomic_add(
            dk_head + offsets, dk_part, mask=tile_in_bounds(keys, seqlen_k, cols, head_dim, EVEN_D), sem="relaxed"
        )
        visited += 1
    return dq, visited


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=[
    "head_dim", "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "head_dim_v", "window_left",
    "window_right", "stride_alibi_b", "stride_alibi_h",
])  # fmt: skip
def atomic_backward_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_acc_ptr, dv_acc_ptr, seqlens_ptr, counts_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_accb, stride_acch, stride_accn,
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, sm_scale, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    stride_dv_accb, stride_dv_acch, stride_dv_accn,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DELTA_RECOMPUTE: tl.constexpr, MASK_STAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, DEBUG: tl.constexpr,
):  # fmt: skip
    """dQ of one Q block and its dK/dV contributions; grid: 1-d, num_m_blocks * B * H programs.

    The K/V stages are the forward's (``common.kv_loop_bounds``): the window's left edge (WINDOW_LEFT), the unmasked
    tiles, the right edge or padding (MASK_STAGE); a stage that cannot run is not compiled.  do and v have their own
    head dim (``head_dim_v``; DV_IS_D: q's, read from ``head_dim``, and the dV accumulator takes dK's strides).
    DEBUG writes (visited, skipped) K/V tile counts of the main (atomic) pass.
    """
    if DV_IS_D:
        head_dim_v = head_dim
        stride_dv_accb = stride_accb
        stride_dv_acch = stride_acch
        stride_dv_accn = stride_accn
    pid = tl.program_id(0)
    bh, m_block, batch, head, kv_head = q_block_program(pid, num_m_blocks, num_heads, group_size, CAUSAL)
    start_m = m_block * BLOCK_M
    seqlen_k_b = batch_seqlen_k(seqlens_ptr, batch, seqlen_k, HAS_SEQLENS)

    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    q_head = head_pointer(q_ptr, batch, head, stride_qb, stride_qh)
    do_head = head_pointer(do_ptr, batch, head, stride_dob, stride_doh)
    k_head = head_pointer(k_ptr, batch, kv_head, stride_kb, stride_kh)
    v_head = head_pointer(v_ptr, batch, kv_head, stride_vb, stride_vh)
    dk_head = head_pointer(dk_acc_ptr, batch, kv_head, stride_accb, stride_acch)
    dv_head = head_pointer(dv_acc_ptr, batch, kv_head, stride_dv_accb, stride_dv_acch)
    q_tile = load_tile(
        tile_pointers(q_head, start_m, local_m, cols, stride_qm, stride_qd), rows, seqlen_q, cols,
        head_dim, EVEN_D, True,
    )  # fmt: skip
    do_tile = load_tile(
        tile_pointers(do_head, start_m, local_m, cols_v, stride_dom, stride_dod), rows, seqlen_q, cols_v,
        head_dim_v, EVEN_DV, True,
    )  # fmt: skip
    row_offset = as_int64(bh) * seqlen_q
    lse2 = load_lse2(lse_ptr + row_offset + rows, rows, seqlen_q, True)
    start, unmasked_start, unmasked_end, end = kv_loop_bounds(
        start_m, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    diagonal_offset = seqlen_k - seqlen_q
    band = (window_left, window_right)
    modifiers = (cap_in, cap_out, alibi_slope2(alibi_ptr, batch, head, stride_alibi_b, stride_alibi_h, ALIBI))

    if DELTA_RECOMPUTE:
        delta = tl.zeros([BLOCK_M], tl.float32)
        if WINDOW_LEFT:
            delta = _delta_recompute_stage(
                delta, q_tile, do_tile, lse2, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
                rows, start, unmasked_start, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
                modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                SOFTCAP, ALIBI, True, DOT_PRECISION,
            )  # fmt: skip
        delta = _delta_recompute_stage(
            delta, q_tile, do_tile, lse2, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
            rows, unmasked_start, unmasked_end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
            modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            SOFTCAP, ALIBI, False, DOT_PRECISION,
        )  # fmt: skip
        if MASK_STAGE:
            delta = _delta_recompute_stage(
                delta, q_tile, do_tile, lse2, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
                rows, unmasked_end, end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
                modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                SOFTCAP, ALIBI, True, DOT_PRECISION,
            )  # fmt: skip
    else:
        delta = tl.load(delta_ptr + row_offset + rows, mask=rows < seqlen_q, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.zeros([], tl.int32)
    if WINDOW_LEFT:
        dq, visited = _atomic_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_head, v_head, dk_head, dv_head,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_accn, stride_dv_accn, rows, start, unmasked_start,
            diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, True,
            DOT_PRECISION,
        )  # fmt: skip
    dq, visited = _atomic_stage(
        dq, visited, q_tile, do_tile, lse2, delta, k_head, v_head, dk_head, dv_head,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_accn, stride_dv_accn, rows, unmasked_start, unmasked_end,
        diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim, head_dim_v, band, modifiers,
        EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, False,
        DOT_PRECISION,
    )  # fmt: skip
    if MASK_STAGE:
        dq, visited = _atomic_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_head, v_head, dk_head, dv_head,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_accn, stride_dv_accn, rows, unmasked_end, end,
            diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, True,
            DOT_PRECISION,
        )  # fmt: skip
    dq_head = head_pointer(dq_ptr, batch, head, stride_dqb, stride_dqh)
    store_tile(
        tile_pointers(dq_head, start_m, local_m, cols, stride_dqm, stride_dqd),
        (dq * sm_scale).to(dq_ptr.dtype.element_ty),
        rows,
        seqlen_q,
        cols,
        head_dim,
        EVEN_D,
    )
    if DEBUG:
        program = bh * num_m_blocks + m_block
        total = tl.cdiv(seqlen_k, BLOCK_N)
        tl.store(counts_ptr + program * 2, visited)
        tl.store(counts_ptr + program * 2 + 1, total - visited)


def attention_backward_atomic(
    call: PreparedCall, do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, delta_mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``[B, H, Nq, D]``, dk ``[B, Hkv, Nk, D]``, dv ``[B, Hkv, Nk, Dv]`` (dtype of q) with atomic dK/dV
    accumulation.

    ``delta_mode``: ``"recompute"`` (second pass over K/V inside the kernel) or ``"preprocess"``.
    """
    if delta_mode not in DELTA_MODES:
        raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta_mode!r}")
    q, k, v = call.q, call.k, call.v
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    lse = lse.contiguous()
    do, o = int32_addressable(do), int32_addressable(o)
    recompute = delta_mode == "recompute"
    variant = KernelVariant.ATOMIC_RECOMPUTE if recompute else KernelVariant.ATOMIC_PREPROCESS
    delta = _placeholder(q.device) if recompute else compute_delta(call, o, do)  # not read when recomputing
    dq = call.new_output((B, H, Nq, D), q.dtype)
    # float32 sums; zeroed before every launch (also before each autotuning trial) by reset().
    dk_acc = torch.empty((B, Hkv, Nk, D), dtype=torch.float32, device=q.device)
    dv_acc = torch.empty((B, Hkv, Nk, Dv), dtype=torch.float32, device=q.device)
    modifiers = call.modifiers

    def reset() -> None:
        dk_acc.zero_()
        dv_acc.zero_()

    def launch(cfg) -> None:
        num_m_blocks = num_blocks(Nq, cfg.block_m)
        programs = num_m_blocks * B * H
        atomic_backward_kernel[grid_1d(programs)](
            q, k, v, do, lse, delta, dq, dk_acc, dv_acc, call.seqlens, call.counts_for(variant, programs),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *dk_acc.stride()[:3],
            H, call.group_size, Nq, Nk, num_m_blocks, call.scale, call.scale * LOG2E, D, *modifiers.args,
            *dv_acc.stride()[:3],
            EVEN_D=call.even_d, BLOCK_D=call.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=call.causal, HAS_SEQLENS=call.has_seqlens, DELTA_RECOMPUTE=recompute,
            MASK_STAGE=call.mask_stage_needed(cfg.block_n), DOT_PRECISION=call.dot_precision, DEBUG=call.debug,
            **modifiers.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    run(call, variant, launch, reset=reset)
    return dq, dk_acc.to(q.dtype), dv_acc.to(v.dtype)
