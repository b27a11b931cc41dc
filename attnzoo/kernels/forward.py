"""FlashAttention-2 forward in Triton, shared by ``triton_2kernel`` and ``triton_atomic``.

One program per (Q block, batch*head): the ``[BLOCK_M, D]`` Q tile stays in registers while K/V tiles stream
through shared memory.  The K/V range is split in two stages: whole tiles that every row sees (no mask
arithmetic at all) and the diagonal/padding tiles that need the mask; tiles no real row sees are never loaded.
Accumulators are float32; the output is normalised once at the end and ``lse`` (natural log) is saved for
the backward.

FLOPs: 4*B*H*Nq*Nk*D (two matrix products of 2*Nq*Nk*D each); minimal bytes: (|q| + |k| + |v| + |o|) * itemsize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from . import compiled_launch
from .common import (
    LOG2E,
    alibi_slope2,
    fp8_factors,
    head_rows,
    key_visible,
    kv_loop_bounds,
    load_kv_tile,
    load_rows,
    modified_scores,
    online_softmax_step,
    q_block_opening,
    row_stats_offset,
    store_rows,
)
from .forward_gluon import attention_forward_hopper
from .gluon_hopper import record_compile_failure
from .launch import KernelVariant, PreparedCall, grid_1d, run, tensor_args


@triton.jit
def _forward_stage(
    acc, m_i, l_i, visited, q_tile, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
    rows, lo, hi, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, FOLD_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Stream the K/V tiles ``[lo, hi)`` of the matrices ``k_rows``/``v_rows`` (``common.head_rows``) through the
    online softmax (MASKED: apply the visibility mask).

    ``band = (window_left, window_right)`` and ``modifiers = (cap_in, cap_out, slope2)`` are read only under their
    flags (``common.key_visible``, ``common.modified_scores``).
    FOLD_SCALE: fold ``qk_scale`` (then positive) into the softmax's exponent, one FFMA per score
    (``PreparedCall.fold_scale`` says when; never with a score modifier).
    USE_TMA: load K/V through the descriptors ``k_desc``/``v_desc`` (``common.load_kv_tile``); unmasked tiles only.
    """
    window_left, window_right = band
    cap_in, cap_out, slope2 = modifiers
    local_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + local_n
        k_tile = load_kv_tile(
            k_rows, k_desc, batch, kv_head, start_n, local_n, cols, seqlen_k_b, head_dim,
            EVEN_D, MASKED, USE_TMA, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        if SOFTCAP or ALIBI:
            qk, _dcap = modified_scores(
                qk, qk_scale, rows[:, None], keys[None, :], diagonal_offset, cap_in, cap_out, slope2, SOFTCAP, ALIBI
            )
            step_scale = 1.0
        elif FOLD_SCALE:
            step_scale = qk_scale
        else:
            # Scale first, then the step multiplies by 1.  (A negative or zero scale could not be folded: the
            # max of the raw scores is not that of the scaled ones, and a hidden -inf times it is not -inf.)
            qk = qk * qk_scale
            step_scale = 1.0
        if MASKED:
            visible = key_visible(
                rows[:, None], keys[None, :], diagonal_offset, seqlen_k_b, window_left, window_right,
                CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            )  # fmt: skip
            qk = tl.where(visible, qk, float("-inf"))
        v_tile = load_kv_tile(
            v_rows, v_desc, batch, kv_head, start_n, local_n, cols_v, seqlen_k_b, head_dim_v,
            EVEN_DV, MASKED, USE_TMA, BLOCK_N, BLOCK_DV,
        )  # fmt: skip
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, step_scale, v_tile, MASKED, DOT_PRECISION)
        visited += 1
    return acc, m_i, l_i, visited


# Sizes vary per call: no per-value specialisation (one compiled kernel per tile shape, dtype and flags).
@triton.jit(do_not_specialize=[
    "head_dim", "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "head_dim_v", "window_left",
    "window_right", "stride_alibi_b", "stride_alibi_h", "num_sequences", "search_steps",
])  # fmt: skip
def attention_forward_kernel(
    q_ptr, stride_qb, stride_qh, stride_qm, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    v_ptr, stride_vb, stride_vh, stride_vn, stride_vd,
    o_ptr, stride_ob, stride_oh, stride_om, stride_od,
    lse_ptr, k_desc, v_desc, seqlens_ptr, counts_ptr,
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, qk_scale, head_dim,
    head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
    cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DV: tl.constexpr, DV_IS_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    FOLD_SCALE: tl.constexpr, MASK_STAGE: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DEBUG: tl.constexpr, descale_ptr=None, DESCALE: tl.constexpr = False,
):  # fmt: skip
    """o, lse of one Q block of one (batch, head); grid: 1-d, num_m_blocks * B * H programs.

    Each tensor arrives as its pointer and four strides (q, k, v: ``[B, H(kv), N, D(v)]``, o: ``[B, H, Nq, Dv]``);
    lse is contiguous ``[B, H, Nq]``.  The program order is ``common.q_block_program``'s (the longest causal rows
    first).  Up to three stages over the keys (``common.kv_loop_bounds``): the tiles cut by the window's left edge
    (WINDOW_LEFT), the unmasked ones, the tiles on the right edge or the padding (MASK_STAGE: some tile may need the
    mask, ``PreparedCall.mask_stage_needed``); a stage that cannot run is not compiled.
    v and o have their own head dim (``head_dim_v``, tile BLOCK_DV); DV_IS_D: it is q's, and the kernel reads
    ``head_dim`` for both (a call without a value head dim of its own compiles as before).
    DEBUG writes (visited, skipped) K/V tile counts of the program to ``counts_ptr``.
    VARLEN: q, k, v, o are packed ``[total, H, D]`` (passed with their row stride as batch stride), lse is
    ``[H, total_q]``, ``seqlen_q``/``seqlen_k`` are total_q/total_k and each program one block of one sequence
    (``common.q_block_opening``); an idle slot returns at once.
    DESCALE (FP8 inputs, ``attnzoo.attention_fp8``; dense only): ``descale_ptr`` is float32 ``[B, Hkv, 3]``, the
    factors that turn the stored q, k, v of a (batch, kv head) into the real ones.  The scores are scaled by the q and
    k factors with ``qk_scale`` (never folded: a factor may be negative), P is rounded to v's dtype for ``P V`` as
    in any dtype, and o is multiplied by the v factor; o has its own dtype (bfloat16).
    """
    if DV_IS_D:
        head_dim_v = head_dim
    q = (q_ptr, stride_qb, stride_qh, stride_qm, stride_qd)
    k = (k_ptr, stride_kb, stride_kh, stride_kn, stride_kd)
    v = (v_ptr, stride_vb, stride_vh, stride_vn, stride_vd)
    o = (o_ptr, stride_ob, stride_oh, stride_om, stride_od)
    varlen = (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps)
    total_q = seqlen_q
    bh, m_block, batch, head, kv_head, start_m, q_first, k_first, seqlen_q, seqlen_k, seqlen_k_b = q_block_opening(
        tl.program_id(0), num_m_blocks, num_heads, group_size, seqlens_ptr, seqlen_q, seqlen_k, varlen,
        BLOCK_M, CAUSAL, HAS_SEQLENS, VARLEN,
    )  # fmt: skip
    if VARLEN:  # noqa: SIM102  (a constexpr test first: a dense kernel compiles no check)
        if start_m >= seqlen_q:
            return
    if DESCALE:
        tl.static_assert(not (VARLEN or FOLD_SCALE), "FP8 runs dense calls, with the scale applied to the scores")
        q_factor, k_factor, v_descale = fp8_factors(descale_ptr, batch, kv_head, num_heads // group_size)
        qk_scale = qk_scale * q_factor * k_factor  # one scale for the tile
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    k_rows = head_rows(k, k_first, kv_head)
    v_rows = head_rows(v, k_first, kv_head)
    q_tile = load_rows(head_rows(q, q_first, head), start_m, local_m, cols, seqlen_q, head_dim, EVEN_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    visited = tl.zeros([], tl.int32)
    start, unmasked_start, unmasked_end, end = kv_loop_bounds(
        start_m, seqlen_q, seqlen_k, seqlen_k_b, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    diagonal_offset = seqlen_k - seqlen_q
    band = (window_left, window_right)
    modifiers = (cap_in, cap_out, alibi_slope2(alibi_ptr, batch, head, stride_alibi_b, stride_alibi_h, ALIBI))
    if WINDOW_LEFT:
        acc, m_i, l_i, visited = _forward_stage(
            acc, m_i, l_i, visited, q_tile, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
            rows, start, unmasked_start, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
            MASKED=True, FOLD_SCALE=FOLD_SCALE, USE_TMA=False, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    acc, m_i, l_i, visited = _forward_stage(
        acc, m_i, l_i, visited, q_tile, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
        rows, unmasked_start, unmasked_end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band,
        modifiers, EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
        MASKED=False, FOLD_SCALE=FOLD_SCALE, USE_TMA=USE_TMA, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    if MASK_STAGE:
        acc, m_i, l_i, visited = _forward_stage(
            acc, m_i, l_i, visited, q_tile, k_rows, v_rows, k_desc, v_desc, batch, kv_head,
            rows, unmasked_end, end, diagonal_offset, seqlen_k_b, qk_scale, head_dim, head_dim_v, band, modifiers,
            EVEN_D, BLOCK_D, EVEN_DV, BLOCK_DV, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
            MASKED=True, FOLD_SCALE=FOLD_SCALE, USE_TMA=False, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip

    # Rows with no visible key: l = 0, acc = 0, m = -inf -> o = 0, lse = -inf (no NaN).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_tile = acc * (1.0 / l_safe)[:, None]
    if DESCALE:  # P V summed the stored values of v: the real ones are v_descale times them
        o_tile = o_tile * v_descale
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    store_rows(head_rows(o, q_first, head), o_tile, start_m, local_m, cols_v, seqlen_q, head_dim_v, EVEN_DV)
    tl.store(lse_ptr + row_stats_offset(bh, head, q_first, total_q, VARLEN) + rows, lse, mask=rows < seqlen_q)
    if DEBUG:
        total = tl.cdiv(seqlen_k, BLOCK_N)
        program = bh * num_m_blocks + m_block  # counts laid out [B, H, num_m_blocks, 2]
        tl.store(counts_ptr + program * 2, visited)
        tl.store(counts_ptr + program * 2 + 1, total - visited)


def attention_forward(call: PreparedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward on a prepared call -> ``o`` ``[B, H, Nq, Dv]`` (dtype of q), ``lse`` ``[B, H, Nq]`` float32;
    packed (``call.varlen``): ``o`` ``[total_q, H, Dv]``, ``lse`` ``[H, total_q]``.

    The autotuner chooses between this module's kernel and, on Hopper, the Gluon kernel of ``forward_gluon.py``
    (``gluon`` configs): the same contract, the softmax overlapped with the matrix products.
    """
    q, k, v = call.q, call.k, call.v
    H, D = call.problem.heads, call.problem.head_dim
    o = call.new_output(call.output_shape(call.problem.head_dim_v), call.output_dtype)
    lse = call.new_output(call.row_stats_shape, torch.float32)
    hopper = not call.gluon_reasons(KernelVariant.FORWARD)
    modifiers = call.modifiers

    def launch(cfg) -> None:
        # A packed batch or FP8 inputs run one Q block per program: a persistent config runs its Triton twin there.
        if cfg.gluon and hopper and not (cfg.persistent and (call.varlen or call.descale is not None)):
            try:
                attention_forward_hopper(
                    q, k, v, o, lse, call.scale, call.causal, modifiers,
                    cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.persistent,
                    varlen=call.varlen_args if call.varlen else None, descale=call.descale,
                    launch_key=call.launch_key(),
                )  # fmt: skip
                return
            except CompilationError as error:  # Gluon's API drifted (frontend error): the Triton kernel's tiles serve
                record_compile_failure(error)
        num_m_blocks = call.q_slots(cfg.block_m)
        use_tma, k_desc, v_desc = call.kv_tile_descriptors(cfg)
        programs = call.q_programs(cfg.block_m)
        compiled_launch.launch(
            attention_forward_kernel, grid_1d(programs), call.launch_key(),
            *tensor_args(q), *tensor_args(k), *tensor_args(v), *tensor_args(o), lse,
            k_desc, v_desc, call.seqlens, call.counts_for(KernelVariant.FORWARD, programs),
            H, call.group_size, call.seqlen_q, call.seqlen_k, num_m_blocks, call.scale * LOG2E, D,
            *modifiers.args, *call.varlen_args, VARLEN=call.varlen,
            EVEN_D=call.even_d, BLOCK_D=call.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=call.causal, HAS_SEQLENS=call.has_seqlens, FOLD_SCALE=call.fold_scale,
            MASK_STAGE=call.mask_stage_needed(cfg.block_n), USE_TMA=use_tma, DOT_PRECISION=call.dot_precision,
            DEBUG=call.debug, **modifiers.flags, **call.descale_args,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    run(call, KernelVariant.FORWARD, launch, gluon_in_scope=hopper)
    return o, lse
