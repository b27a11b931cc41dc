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

On Hopper the ``gluon`` configs of the same variant run the five-product backward instead: the K/V-stationary Gluon
kernel of ``backward_gluon.py`` (``DQ_ATOMIC``) writes dK/dV and adds dQ atomically, optionally in a fixed order
(``ordered``, ``triton_atomic(deterministic=True)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from .._env import triton_interpreter_active
from . import compiled_launch
from .backward_2kernel import attention_backward_2kernel
from .backward_gluon import attention_dkdv_hopper, dq_staging_order
from .common import (
    LOG2E,
    alibi_slope2,
    as_int64,
    head_rows,
    kv_loop_bounds,
    load_lse2,
    load_rows,
    q_block_opening,
    recompute_tile_p,
    row_delta,
    row_stats_offset,
    store_rows,
    tile_in_bounds,
    tile_pointers,
)
from .gluon_hopper import record_compile_failure
from .launch import KernelVariant, PreparedCall, _placeholder, aligned_value_rows, grid_1d, num_blocks, run, tensor_args
from .tuning import INTERPRETER_CONFIG

DELTA_MODES = ("recompute", "preprocess")
PREPROCESS_BLOCK_M = 64


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=["head_dim", "num_heads", "seqlen_q", "num_m_blocks"])
def delta_preprocess_kernel(
    o_ptr, stride_ob, stride_oh, stride_om, stride_od,
    do_ptr, stride_dob, stride_doh, stride_dom, stride_dod,
    delta_ptr, lse_ptr, lse2_ptr, num_heads, seqlen_q, num_m_blocks, head_dim,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, WRITE_LSE2: tl.constexpr,
):  # fmt: skip
    """``delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]`` in float32; delta is contiguous ``[B, H, Nq]``.
    WRITE_LSE2: also ``lse2 = lse * log2(e)`` (+inf for an empty row), contiguous as delta, for the Gluon kernel.

    (``head_dim``/BLOCK_D are those of o and do: v's head dim.)
    """
    o = (o_ptr, stride_ob, stride_oh, stride_om, stride_od)
    do = (do_ptr, stride_dob, stride_doh, stride_dom, stride_dod)
    pid = tl.program_id(0)
    bh = pid // num_m_blocks
    start_m = (pid % num_m_blocks) * BLOCK_M
    batch = bh // num_heads
    head = bh % num_heads
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    cols = tl.arange(0, BLOCK_D)
    o_tile = load_rows(head_rows(o, batch, head), start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, True)
    do_tile = load_rows(head_rows(do, batch, head), start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, True)
    delta = row_delta(o_tile, do_tile)
    tl.store(delta_ptr + as_int64(bh) * seqlen_q + rows, delta, mask=rows < seqlen_q)
    if WRITE_LSE2:
        lse2 = load_lse2(lse_ptr + as_int64(bh) * seqlen_q + rows, rows, seqlen_q, True)
        tl.store(lse2_ptr + as_int64(bh) * seqlen_q + rows, lse2, mask=rows < seqlen_q)


def compute_delta(
    call: PreparedCall, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Delta = rowsum(dO * O)`` -> float32 ``[B, H, Nq]`` (one pass over O and dO instead of over K/V); packed
    (``call.varlen``), ``[1, H, total_q]``: the ``[H, total_q]`` layout the kernels read (a sum per row needs no
    sequence boundaries, so the packed rows are one sequence here).  With ``lse`` (contiguous, Delta's layout),
    also ``lse2``, lse in base 2 with +inf for an empty row (else None).

    (The two-kernel backward computes the same sums inside its dQ kernel instead.)
    """
    if call.varlen:
        o, do = o.transpose(0, 1).unsqueeze(0), do.transpose(0, 1).unsqueeze(0)
    B, H, Nq, Dv = o.shape
    delta = call.new_output((B, H, Nq), torch.float32)
    lse2 = None if lse is None else call.new_output((B, H, Nq), torch.float32)
    block_m = INTERPRETER_CONFIG.block_m if triton_interpreter_active() else PREPROCESS_BLOCK_M
    num_m_blocks = num_blocks(Nq, block_m)
    launch_key = call.launch_key(o, do) if lse is None else call.launch_key(o, do, lse)
    compiled_launch.launch(
        delta_preprocess_kernel, grid_1d(num_m_blocks * B * H), launch_key,
        *tensor_args(o), *tensor_args(do), delta, delta if lse is None else lse, delta if lse2 is None else lse2,
        H, Nq, num_m_blocks, head_dim=Dv, EVEN_D=call.modifiers.flags["EVEN_DV"], BLOCK_D=call.block_dv,
        BLOCK_M=block_m, WRITE_LSE2=lse is not None, num_warps=4,
    )  # fmt: skip
    return delta, lse2


@triton.jit
def _delta_recompute_stage(
    delta, q_tile, do_tile, lse2, k_rows, v_rows,
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
        k_tile = load_rows(k_rows, start_n, local_n, cols, seqlen_k_b, head_dim, EVEN_D, MASKED)
        v_tile = load_rows(v_rows, start_n, local_n, cols_v, seqlen_k_b, head_dim_v, EVEN_DV, MASKED)
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
    dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, dk_acc_rows, dv_acc_rows,
    rows, lo, hi, diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ in registers, dK/dV contributions of every K/V tile in ``[lo, hi)`` added atomically into the float32
    matrices ``dk_acc_rows``/``dv_acc_rows`` (``common.head_rows`` of the accumulators)."""
    local_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    dk_acc_head, dk_acc_stride_n, dk_acc_stride_d = dk_acc_rows
    dv_acc_head, dv_acc_stride_n, dv_acc_stride_d = dv_acc_rows
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + local_n
        k_tile = load_rows(k_rows, start_n, local_n, cols, seqlen_k_b, head_dim, EVEN_D, MASKED)
        v_tile = load_rows(v_rows, start_n, local_n, cols_v, seqlen_k_b, head_dim_v, EVEN_DV, MASKED)
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
        # The accumulators are [B, Hkv, Nk, D(v)]: rows past Nk do not exist (keys past seqlens_k add zeros).
        tl.atomic_add(
            tile_pointers(dv_acc_head, start_n, local_n, cols_v, dv_acc_stride_n, dv_acc_stride_d), dv_part,
            mask=tile_in_bounds(keys, seqlen_k, cols_v, head_dim_v, EVEN_DV), sem="relaxed",
        )  # fmt: skip
        tl.atomic_add(
            tile_pointers(dk_acc_head, start_n, local_n, cols, dk_acc_stride_n, dk_acc_stride_d), dk_part,
            mask=tile_in_bounds(keys, seqlen_k, cols, head_dim, EVEN_D), sem="relaxed",
        )  # fmt: skip
        visited += 1
    return dq, visited


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=[
    "head_dim", "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "head_dim_v", "window_left",
    "window_right", "stride_alibi_b", "stride_alibi_h", "num_sequences", "search_steps",
])  # fmt: skip
def atomic_backward_kernel(
    q_ptr, stride_qb, stride_qh, stride_qm, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    v_ptr, stride_vb, stride_vh, stride_vn, stride_vd,
    do_ptr, stride_dob, stride_doh, stride_dom, stride_dod,
    dq_ptr, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    dk_acc_ptr, stride_dk_accb, stride_dk_acch, stride_dk_accn, stride_dk_accd,
    dv_acc_ptr, stride_dv_accb, stride_dv_acch, stride_dv_accn, stride_dv_accd,
    lse_ptr, delta_ptr, seqlens_ptr, counts_ptr,
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, sm_scale, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DELTA_RECOMPUTE: tl.constexpr, MASK_STAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, DEBUG: tl.constexpr,
):  # fmt: skip
    """dQ of one Q block and its dK/dV contributions; grid: 1-d, num_m_blocks * B * H programs.

    Each tensor arrives as its pointer and four strides (the float32 accumulators ``dk_acc``/``dv_acc`` too); lse
    and Delta are contiguous ``[B, H, Nq]``.  The K/V stages are the forward's (``common.kv_loop_bounds``): the
    window's left edge (WINDOW_LEFT), the unmasked tiles, the right edge or padding (MASK_STAGE); a stage that cannot
    run is not compiled.  do and v have their own head dim (``head_dim_v``; DV_IS_D: q's, read from ``head_dim``, and
    the dV accumulator takes dK's strides).
    DEBUG writes (visited, skipped) K/V tile counts of the main (atomic) pass.
    VARLEN: packed tensors and accumulators, lse/Delta ``[H, total_q]``, one block of one sequence per program (as the
    forward); the atomic additions stop at the sequence's last key.
    """
    if DV_IS_D:
        head_dim_v = head_dim
        stride_dv_accb = stride_dk_accb
        stride_dv_acch = stride_dk_acch
        stride_dv_accn = stride_dk_accn
    q = (q_ptr, stride_qb, stride_qh, stride_qm, stride_qd)
    k = (k_ptr, stride_kb, stride_kh, stride_kn, stride_kd)
    v = (v_ptr, stride_vb, stride_vh, stride_vn, stride_vd)
    do = (do_ptr, stride_dob, stride_doh, stride_dom, stride_dod)
    dq_out = (dq_ptr, stride_dqb, stride_dqh, stride_dqm, stride_dqd)
    dk_acc = (dk_acc_ptr, stride_dk_accb, stride_dk_acch, stride_dk_accn, stride_dk_accd)
    dv_acc = (dv_acc_ptr, stride_dv_accb, stride_dv_acch, stride_dv_accn, stride_dv_accd)
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
    dk_acc_rows = head_rows(dk_acc, k_first, kv_head)
    dv_acc_rows = head_rows(dv_acc, k_first, kv_head)
    q_tile = load_rows(head_rows(q, q_first, head), start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, True)
    do_tile = load_rows(head_rows(do, q_first, head), start_m, local_m, cols_v, seqlen_q, head_dim_v, EVEN_DV, True)
    row_offset = row_stats_offset(bh, head, q_first, total_q, VARLEN)
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
                delta, q_tile, do_tile, lse2, k_rows, v_rows, rows, start, unmasked_start, diagonal_offset,
                seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV,
                BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=True, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        delta = _delta_recompute_stage(
            delta, q_tile, do_tile, lse2, k_rows, v_rows, rows, unmasked_start, unmasked_end, diagonal_offset,
            seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV,
            BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=False, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        if MASK_STAGE:
            delta = _delta_recompute_stage(
                delta, q_tile, do_tile, lse2, k_rows, v_rows, rows, unmasked_end, end, diagonal_offset,
                seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV,
                BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=True, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
    else:
        delta = tl.load(delta_ptr + row_offset + rows, mask=rows < seqlen_q, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.zeros([], tl.int32)
    if WINDOW_LEFT:
        dq, visited = _atomic_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, dk_acc_rows, dv_acc_rows,
            rows, start, unmasked_start, diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim,
            head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=True, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    dq, visited = _atomic_stage(
        dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, dk_acc_rows, dv_acc_rows,
        rows, unmasked_start, unmasked_end, diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim,
        head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT,
        WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=False, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    if MASK_STAGE:
        dq, visited = _atomic_stage(
            dq, visited, q_tile, do_tile, lse2, delta, k_rows, v_rows, dk_acc_rows, dv_acc_rows,
            rows, unmasked_end, end, diagonal_offset, seqlen_k, seqlen_k_b, sm_scale, qk_scale, head_dim,
            head_dim_v, band, modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, SOFTCAP, ALIBI, MASKED=True, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    store_rows(head_rows(dq_out, q_first, head), dq * sm_scale, start_m, local_m, cols, seqlen_q, head_dim, EVEN_D)
    if DEBUG:
        program = bh * num_m_blocks + m_block
        total = tl.cdiv(seqlen_k, BLOCK_N)
        tl.store(counts_ptr + program * 2, visited)
        tl.store(counts_ptr + program * 2 + 1, total - visited)


def attention_backward_atomic(
    call: PreparedCall, do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, delta_mode: str, ordered: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``[B, H, Nq, D]``, dk ``[B, Hkv, Nk, D]``, dv ``[B, Hkv, Nk, Dv]`` (dtype of q) with atomic accumulation.

    ``delta_mode``: ``"recompute"`` (second pass over K/V inside the kernel) or ``"preprocess"``.  With
    "preprocess", calls in ``KernelVariant.ATOMIC_PREPROCESS.gluon_scope`` may run a ``gluon`` config: the
    K/V-stationary Gluon kernel of ``backward_gluon.py`` writing dK/dV and adding dQ atomically (five products per
    tile).  ``ordered``: that kernel with the dQ additions in a fixed order (bitwise reproducible); outside its scope
    (or where it does not compile) the two-kernel backward, which is reproducible too.
    """
    if delta_mode not in DELTA_MODES:
        raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta_mode!r}")
    q, k, v = call.q, call.k, call.v
    B, H, D = q.shape[0], call.problem.heads, call.problem.head_dim  # (B: dense calls' only, as the Gluon path)
    Nq, Nk = call.seqlen_q, call.seqlen_k  # packed: total_q, total_k
    lse = lse.contiguous()
    do, o = aligned_value_rows(do, call), aligned_value_rows(o, call)
    recompute = delta_mode == "recompute"
    if ordered:
        variant = KernelVariant.ATOMIC_ORDERED
    else:
        variant = KernelVariant.ATOMIC_RECOMPUTE if recompute else KernelVariant.ATOMIC_PREPROCESS
    hopper = not recompute and not call.gluon_reasons(variant, do)
    if ordered and not hopper:  # no fixed order for the Triton kernel's atomics: the two-kernel backward has one
        return attention_backward_2kernel(call, do, o, lse)
    if recompute:
        delta, lse2 = _placeholder(q.device), None  # not read
    else:
        delta, lse2 = compute_delta(call, o, do, lse if hopper else None)
    modifiers = call.modifiers
    launch_key = call.launch_key(do, o, lse)
    # The last launch's dq, dk, dv in the inputs' dtypes (the float32 sums cast: part of each path's cost when the
    # tuner times them).  Buffers are made by the first launch that needs them, and each launch zeroes the sums it
    # adds into first (autotuning trials included).
    buffers: dict[str, torch.Tensor] = {}
    result: list[tuple] = []

    def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
        # Outputs come from call.new_output (NaN-filled under the tests: an unwritten element fails them); sums and
        # locks are zeroed here.
        if name not in buffers or buffers[name].shape != shape:
            if zeroed:
                buffers[name] = torch.empty(shape, dtype=dtype, device=q.device)
            else:
                buffers[name] = call.new_output(shape, dtype)
        return buffers[name].zero_() if zeroed else buffers[name]

    def launch(cfg) -> None:
        result.clear()
        if ordered and not cfg.gluon:
            raise ValueError(f"ordered dQ additions: {cfg} is not a gluon config (the Triton kernel has no order)")
        if cfg.gluon and hopper:
            try:
                # Rows padded to whole Q tiles: the padding rows take the zero shares of TMA's zero rows, and the
                # additions need no row mask.
                tiles = num_blocks(Nq, cfg.block_m)
                dq_acc = buffer("dq_acc", (B, H, tiles * cfg.block_m, D), torch.float32, zeroed=True)
                # Two locks per Q tile: one per column part a warp-specialised block's warpgroup adds at D = 128 (at
                # D = 64 its warpgroups take turns on the first, as the 64-key block uses it).
                dq_locks = buffer("dq_locks", (B, H, tiles, 2), torch.int32, zeroed=True) if ordered else None
                dk, dv = buffer("dk", k.shape, q.dtype), buffer("dv", v.shape, q.dtype)
                attention_dkdv_hopper(
                    q, k, v, do, lse2, delta, dk, dv, call.scale, call.causal, modifiers,
                    cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, dq_acc=dq_acc, dq_locks=dq_locks,
                    launch_key=launch_key,
                )  # fmt: skip
            except CompilationError as error:  # Gluon's API drifted (frontend error): the Triton kernel serves
                record_compile_failure(error)
                if ordered:
                    raise
            else:
                result.append((dq_staging_order(dq_acc, Nq, q.dtype), dk, dv))
                return
        dq = buffer("dq", q.shape, q.dtype)
        dk_acc = buffer("dk_acc", k.shape, torch.float32, zeroed=True)
        dv_acc = buffer("dv_acc", v.shape, torch.float32, zeroed=True)
        num_m_blocks = call.q_slots(cfg.block_m)
        programs = call.q_programs(cfg.block_m)
        compiled_launch.launch(
            atomic_backward_kernel, grid_1d(programs), launch_key,
            *tensor_args(q), *tensor_args(k), *tensor_args(v), *tensor_args(do), *tensor_args(dq),
            *tensor_args(dk_acc), *tensor_args(dv_acc), lse, delta, call.seqlens, call.counts_for(variant, programs),
            H, call.group_size, Nq, Nk, num_m_blocks, call.scale, call.scale * LOG2E, D, *modifiers.args,
            *call.varlen_args, VARLEN=call.varlen,
            EVEN_D=call.even_d, BLOCK_D=call.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=call.causal, HAS_SEQLENS=call.has_seqlens, DELTA_RECOMPUTE=recompute,
            MASK_STAGE=call.mask_stage_needed(cfg.block_n), DOT_PRECISION=call.dot_precision, DEBUG=call.debug,
            **modifiers.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        result.append((dq, dk_acc.to(q.dtype), dv_acc.to(v.dtype)))

    try:
        run(call, variant, launch, gluon_in_scope=hopper)
    except CompilationError:
        if not ordered:
            raise
        return attention_backward_2kernel(call, do, o, lse)  # (recorded) the ordered additions have no Triton twin
    return result[0]
