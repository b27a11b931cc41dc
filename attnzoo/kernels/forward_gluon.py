"""The forward for Hopper written in Gluon: the softmax of one K/V tile runs while the tensor cores do the previous
tile's ``P V``, and with 128-row tiles one warpgroup's softmax runs while the other's products do.

``forward.py``'s Triton kernel waits for each ``S = Q K^T`` before its softmax and for the softmax before
``P V``: on the H100 the tensor cores idle during the exponentials (ncu: tensor pipe active 50% of the time at
D=128, cuDNN 74%; docs/design.md), and Triton 3.6 neither keeps such a product asynchronous nor compiles
warp specialisation on Hopper.  Gluon (``triton.experimental.gluon``) exposes the asynchronous ``wgmma`` and its
wait directly, so each warpgroup (64 query rows) orders its loop as FlashAttention-3 does (Shah et al., 2024,
"intra-warpgroup overlapping", their Algorithm 2).  Iteration ``j``:

    issue  S_j = Q K_j^T                      (asynchronous)
    scale  O *= alpha_{j-1}; issue O += P_{j-1} V_{j-1}  (asynchronous, behind S_j)
    wait until only the newest product is in flight -> S_j is done
    softmax of S_j -> P_j, alpha_j            (while the tensor cores run P_{j-1} V_{j-1})
    wait for P_{j-1} V_{j-1}

K/V tiles arrive by TMA into rings of NUM_STAGES shared-memory slots; slot ``i``'s "ready" mbarrier completes when
its bytes have landed.  Two arrangements, by the number of warpgroups per Q block:

- one warpgroup (64 rows): the warpgroup refills a slot itself, at the top of the iteration after its readers were
  waited for (a barrier of its 4 warps), NUM_STAGES - 1 iterations before the tile is needed.  Small (74-80 KB of
  shared memory, <= 160 registers), so two or three CTAs share an SM and interleave their phases.
- two warpgroups (128 rows), warp-specialised (``gl.warp_specialize``): a producer warp issues every TMA copy, and
  each warpgroup releases a slot by arriving on its "empty" mbarrier once its products have read it.  Nothing else
  ties the warpgroups together, so they drift apart and one's exponentials fill the time of the other's products
  (FlashAttention-3's "ping-pong", here left to the warp schedulers).  On the H100 this made the 128 x 128 tile
  1.20-1.24x faster at D=128 than the same tile with both warpgroups issuing their own loads, in step, at four
  CTA-wide barriers per iteration (fp16, N = 2k and 8k), and 1.15-1.29x faster than the best 64-row tile (fp16 and
  bf16; docs/design.md).

The warp-specialised block also runs persistent (a ``persistent`` config): one program per SM takes the Q blocks
``program_id + k * num_programs`` in turn, the rings' slot numbers running on across blocks.  Where the shared
memory holds two sets of Q slots, one slot a warpgroup each (``persistent_q_sets``: among the candidates, D = 64 and 128
at two stages), the producer loads a block's Q rows into the set that the block before last has left (its O stored
through them: a ``q_empty`` barrier per slot), before the block's first K/V tile, while the warpgroups still run the
previous block; so a warpgroup goes from one block's epilogue to the next block's first product without waiting for
a copy, and waits for its O store only once that product is issued (then it releases the set).  With one set, the Q
rows load only once the warpgroup has stored the previous block's O through them, after the block's first K/V tile.
At N <= 2k, or in a window of 1024 keys, a block has 1-16 K/V tiles, and the prologue and epilogue of a block weigh.

Scope (``KernelVariant.FORWARD.gluon_scope`` in ``launch.py`` says why a call runs ``forward.py``'s kernel
instead): an sm_90 GPU, float16/bfloat16 (or FP8 inputs, DESCALE: ``attnzoo.attention_fp8`` at D = Dv = 64 or 128,
dense and not persistent), the (D, Dv) pairs the scope lists (64/64, 128/128, 192/128, 256/256), no
``seqlens_k`` (TMA zero-fills past Nk only: V rows past ``seqlens_k[b]`` may hold NaN, and ``0 * NaN`` would reach
``P V``), a positive scale, and q/k/v that a TMA descriptor can address.  A head dim that is the sum of two powers of
two (192 = 128 + 64: Gluon tiles have power-of-two shapes) comes as two column parts of Q and K, and ``S = Q K^T`` as
two chained products; Dv is a power of two (DeepSeek's 192/128).  ``tests/test_gpu_score_modifiers.py`` checks the
kernel with such pairs on the GPU; the scope lists a pair once that test has passed for it.  D = Dv = 256 (the
warp-specialised 128x64 tile, or one warpgroup's 64x64) is checked by ``tests/test_gpu.py`` on dense calls with
each score modifier and by ``tests/test_gpu_varlen.py`` on a packed batch.  Its packed build spills 4-80 B in
ptxas (Triton 3.6 / 3.9): the producer warp, at 24 registers, zeroes a sequence's last V tile past its end (once
per Q block) 128 columns at a time.
Causal masks, windows (the loop starts at the window's first tile: blocks outside the band are never loaded), the
soft cap, ALiBi, any Nq and Nk, and grouped-query heads are handled.  Packed batches (``attention_varlen``) run with
VARLEN, one Q block per program (not persistent): a sequence's TMA boxes reach into the next sequence's rows, so the
rows of its last V tile past its end are zeroed before ``P V`` and an O slab that its end cuts leaves by masked
stores (``_attend_rows``).  Results are the same online softmax as
``forward.py`` (not bitwise: the products are summed in another order).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import compiled_launch
from .common import (
    LOG2E,
    fp8_factors,
    kv_loop_bounds,
    q_block_opening,
    q_block_program,
    softcap_scores,
    softcap_tanh_scale,
    tanh_approx,
)
from .gluon_hopper import (
    accumulator_layout,
    check_warpgroup_rows,
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    grid_slots,
    head_dim_parts,
    mbarrier,
    packed_views,
    ring_load,
    ring_load_pair,
    ring_wait,
    store_rows_below,
    tile_descriptor,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
    zero_rows_from,
)
from .launch import sm_count
from .tuning import KernelConfig, gluon_shared_memory_estimate, shared_memory_limit

# The kernel's own warps (the first warpgroup); a second warpgroup and the producer warp join as worker partitions.
KERNEL_WARPS = 4

if TYPE_CHECKING:
    from .launch import ScoreModifiers

# The kernel's SOFTCAP: 0 none; 1 the soft cap under the online softmax's running max; 2 the soft cap with the max
# fixed at the cap (``_capped_softmax_step``), which the host chooses (``softcap_form``).
SOFTCAP_RUNNING_MAX, SOFTCAP_FIXED_MAX = 1, 2
# The largest ``cap_out = c * log2(e)`` that takes the fixed max: the smallest p, ``2^(-2 cap_out) >= 2^-96``, leaves
# 30 of float32's binades (bfloat16 has its exponent range) for the products P V below it (c <= 33.3).
FIXED_MAX_CAP_OUT = 48.0

if gluon is not None:
    _SOFTCAP_FIXED_MAX = gl.constexpr(SOFTCAP_FIXED_MAX)  # as the kernels read a global

    @gluon.jit
    def mask_scores(
        s, rows, keys, diagonal_offset, seqlen_k, window_left, window_right,
        CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    ):  # fmt: skip
        """Hide keys past Nk, after the row's diagonal (CAUSAL) and outside the window's band (``common.key_visible``'s
        rule): ``-inf`` scores (``p = 0``)."""
        visible = keys[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + diagonal_offset)
        if WINDOW_RIGHT:
            visible = visible & (keys[None, :] <= rows[:, None] + (diagonal_offset + window_right))
        if WINDOW_LEFT:
            visible = visible & (keys[None, :] >= rows[:, None] + (diagonal_offset - window_left))
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _modified_scores(
        s, rows, keys, diagonal_offset, alibi_cols, qk_scale, cap_in, cap_out, slope2,
        CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    ):  # fmt: skip
        """The base-2 scores of a raw tile with the soft cap and ALiBi (``common.modified_scores``' math; the soft cap
        always in the hardware's ``tanh.approx.f32``, the form the Triton kernels use for float16/bfloat16).

        ALiBi with a causal mask: every visible key j is at or left of its row's position i', so
        ``-slope (i' - j) = slope (j - r0) - slope (i' - r0)`` with r0 the first row's position.  The last term is
        constant along a row: it leaves P unchanged, so it is left out here and taken off the row's lse at the end of
        ``_attend_rows``; the first, ``alibi_cols`` (``[BLOCK_N]``, from ``alibi_key_term``), is one add per score,
        where ``|i' - j|`` takes a subtraction, an absolute value and a multiply-add.  Keys right of the diagonal get
        a wrong score, but the causal mask hides them."""
        if SOFTCAP:
            s2, _ = softcap_scores(s, softcap_tanh_scale(qk_scale, cap_in), cap_out, 2)
        else:
            s2 = s * qk_scale
        if ALIBI:
            if CAUSAL:
                s2 = s2 + alibi_cols[None, :]
            else:
                distance = gl.abs((rows[:, None] + diagonal_offset).to(gl.float32) - keys[None, :].to(gl.float32))
                s2 = s2 - slope2 * distance
        return s2

    @gluon.jit
    def alibi_key_term(alibi_local, first_key, alibi_origin, slope2, CAUSAL: gl.constexpr, ALIBI: gl.constexpr):
        """``slope (j - r0)`` for the keys ``j = first_key + 0..BLOCK_N-1`` of a tile (``_modified_scores``), as the
        tile-invariant ``alibi_local = slope * (0..BLOCK_N-1)`` plus one scalar: no int-to-float conversion per key."""
        if ALIBI and CAUSAL:
            return alibi_local + slope2 * (first_key - alibi_origin).to(gl.float32)
        else:
            return alibi_local

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, DTYPE: gl.constexpr, p_layout: gl.constexpr, P_IN_REGISTERS: gl.constexpr):
        """Online softmax of one score tile ``s`` ``[BLOCK_M, BLOCK_N]`` (``-inf`` = hidden) in base 2, whose base-2
        scores are ``s * qk_scale``: raw scores with ``qk_scale = scale * log2(e)``, ``tanh(s / c)`` with
        ``cap_out`` (the soft cap), scores already modified with 1.0 (ALiBi).

        ``qk_scale > 0``, so the max of the scaled scores is the max of the tile's times it and each score costs one
        FFMA and one exp2.  Returns ``P`` (in the operands' dtype; P_IN_REGISTERS: laid out as
        the left operand of ``P V`` in registers, else as the S accumulator, for ``_stage_p``), ``alpha =
        exp2(m_old - m_new)`` for rescaling O, and the new running max and sum.
        """
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row that has seen no visible key keeps m = -inf; shifting it by 0 keeps exp2(-inf - -inf) = NaN out.
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(s * qk_scale - m_shift[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        if P_IN_REGISTERS:
            p_op = gl.convert_layout(p.to(DTYPE), p_layout)
        else:
            p_op = p.to(DTYPE)
        return p_op, alpha, m_new, l_i

    @gluon.jit
    def _capped_softmax_step(t, l_i, cap_out, DTYPE: gl.constexpr, p_layout: gl.constexpr):
        """The softmax step of soft-capped scores with the max fixed at the cap (SOFTCAP == SOFTCAP_FIXED_MAX), from
        ``t = tanh(s / c)`` ``[BLOCK_M, BLOCK_N]`` (``-inf`` = hidden) -> ``(P, l)``, P laid out as ``P V``'s register
        operand.

        Every base-2 score ``cap_out * t`` is at most ``cap_out``, so with that as the max ``p = exp2(cap_out * t -
        cap_out) <= 1`` for every tile: no max reduction, and no rescale of O or l (``alpha = 1``).  P then spans
        ``[2^(-2 cap_out), 1]``, which a bfloat16 P holds as normal numbers (float32's exponent range); the host
        takes this form only there (``softcap_form``).  Each score costs one FFMA and one exp2, as in
        ``_softmax_step``.
        """
        p = gl.exp2(t * cap_out - cap_out)
        l_i = l_i + gl.sum(p, 1)
        return gl.convert_layout(p.to(DTYPE), p_layout), l_i

    @gluon.jit
    def _stage_p(p, p_smem, slot, DESCALE: gl.constexpr):
        """FP8 (DESCALE): P into its shared-memory slot, from which ``P V`` reads it (``_p_operand``).  A 16-bit P
        stays in registers, kept alive until its product is done by passing it through ``warpgroup_mma_wait``;
        that wait takes no 8-bit values (Triton 3.6-3.9), so an e4m3 P goes through shared memory.  The caller's
        barrier makes every warp's rows land before the product."""
        if DESCALE:
            p_smem.index(slot).store(p)
            fence_async_shared()

    @gluon.jit
    def _p_operand(p, p_smem, slot, DESCALE: gl.constexpr):
        """``P V``'s left operand: P's registers, or (DESCALE) its shared-memory slot."""
        if DESCALE:
            operand = p_smem.index(slot)
        else:
            operand = p
        return operand

    @gluon.jit
    def _zero_tail(tile, first_zero):
        """``zero_rows_from`` by the one warpgroup that both loads and reads ``tile`` (the 64-row block), when the
        tile reaches past its sequence; every warp's writes land before the product that reads the tile."""
        if first_zero < tile.type.shape[0]:
            zero_rows_from(tile, first_zero, 4)
            cta_barrier()

    @gluon.jit
    def _load_qk(desc, desc2, bars, ring, ring2, index, batch, head, row, pred,
                 NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        """A Q or K tile into slot ``index % NUM_STAGES``: one TMA box, or (SPLIT) its two column parts."""
        if SPLIT:
            ring_load_pair(desc, desc2, bars, ring, ring2, index, batch, head, row, pred, NUM_STAGES)
        else:
            ring_load(desc, bars, ring, index, batch, head, row, pred, NUM_STAGES)

    @gluon.jit
    def _issue_scores(q_tile, q2_tile, k_ready, k_ring, k2_ring, index, s,
                      BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
                      NUM_STAGES: gl.constexpr):  # fmt: skip
        """Wait for K tile ``index`` and issue ``S = Q K^T`` into ``s`` (its old value ignored), asynchronously; with a
        second column part (BLOCK_D2 > 0) as two products, the second accumulating onto the first."""
        k_tile = ring_wait(k_ready, k_ring, index, BLOCK_N, BLOCK_D, NUM_STAGES)
        s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s, use_acc=False, is_async=True)
        if BLOCK_D2 > 0:
            k2_tile = k2_ring.index(index % NUM_STAGES).reshape([BLOCK_N, BLOCK_D2])  # same barrier as k_tile
            s = warpgroup_mma(q2_tile, k2_tile.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _load_v(desc, bars, ring, index, batch, head, key, pred, NUM_STAGES: gl.constexpr, KEYS_INNER: gl.constexpr):
        """V tile ``index`` (keys ``key ..``) into its ring slot: a ``[BLOCK_N, Dv]`` box, or (KEYS_INNER, FP8) a
        ``[Dv, BLOCK_N]`` box of the keys-contiguous ``[B, H, Dv, N]`` view of v."""
        if KEYS_INNER:
            slot = index % NUM_STAGES
            bar = bars.index(slot)
            mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
            tma_load(desc, [batch, head, 0, key], bar, ring.index(slot), pred=pred)
        else:
            ring_load(desc, bars, ring, index, batch, head, key, pred, NUM_STAGES)

    @gluon.jit
    def _wait_v(bars, ring, index, BLOCK_N: gl.constexpr, BLOCK_DV: gl.constexpr, NUM_STAGES: gl.constexpr,
                KEYS_INNER: gl.constexpr):  # fmt: skip
        """Wait for V tile ``index``; returns it as ``P V``'s right operand ``[BLOCK_N, Dv]`` (KEYS_INNER: the
        transposed view of a ``[Dv, BLOCK_N]`` slot, whose keys, the product's K, are contiguous: an FP8 ``wgmma``
        takes its right operand K-major only)."""
        if KEYS_INNER:
            v_tile = ring_wait(bars, ring, index, BLOCK_DV, BLOCK_N, NUM_STAGES).permute((1, 0))
        else:
            v_tile = ring_wait(bars, ring, index, BLOCK_N, BLOCK_DV, NUM_STAGES)
        return v_tile

    @gluon.jit
    def _signed_scores(s, flip, DESCALE: gl.constexpr):
        """FP8 (DESCALE): the raw scores times -1 where the product of the q and k factors is negative (``flip``),
        so that the softmax scales them by a positive ``|qk_scale|`` and the masks' ``-inf`` stays hidden."""
        if DESCALE:  # noqa: SIM102 - a compile-time branch around a runtime one
            if flip:
                s = -s
        return s

    @gluon.jit
    def _attend_rows(
        k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, scalars, modifiers, packed,
        WARPGROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
        BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        INLINE_LOADS: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr, VARLEN: gl.constexpr, DESCALE: gl.constexpr, DEFER_O_WAIT: gl.constexpr = False,
    ):  # fmt: skip
        """o and lse of the 64 rows of warpgroup ``WARPGROUP`` of the Q block (4 warps; the loop of the module
        docstring).  INLINE_LOADS: this warpgroup refills the K/V slots itself (the whole block is one warpgroup);
        else it releases each slot to the producer warp with an arrive on the slot's "empty" mbarrier.

        Tile ``j`` holds keys ``first_key + j * BLOCK_N ..``; tiles ``j < left_tiles`` (cut by the window's left
        edge) and ``j >= unmasked_tiles`` (the diagonal, the right edge, Nk) take the mask, the others none.  It is
        number ``kv_base + j`` of the K/V rings (a persistent program's earlier Q blocks used the numbers before), and
        the Q rows arrive in Q slot ``WARPGROUP + q_set_base`` (``q_set_base``: the first slot of the block's set of
        Q slots, 0 but in a persistent program's second set), in phase ``q_phase`` of its barrier; O leaves through
        that slot where it leaves through Q's rows.  DEFER_O_WAIT (a persistent program with two sets): the block
        does not wait for its O store at its end; the next block waits for it right after issuing its first S
        product, so that the store runs under that product, and then releases Q slot ``q_release`` (the previous
        block's; -1 in a program's first block) to the producer.  ``o_factor`` multiplies o (FP8's v factor, else
        1).
        DESCALE (FP8 inputs): q, k, v and P in e4m3, o in bfloat16, V slots keys-contiguous (``_wait_v``), and
        ``qk_scale`` (times the q and k factors) of either sign (``_signed_scores``).
        ``modifiers = (window_left, window_right, cap_in, cap_out, slope2)``, each read only under its flag; with
        ALiBi the scores are scaled and modified before the mask, and the softmax takes them as they are; with the
        soft cap alone the tile holds ``tanh(s / c)`` and the softmax scales it by ``cap_out``.  SOFTCAP ==
        SOFTCAP_FIXED_MAX: the softmax's max is ``cap_out`` from the start (``_capped_softmax_step``).

        ``packed = (coord_batch, row_origin, key_origin, total_q, o_ptr, stride_o_row)``: rows, keys and lengths in
        ``scalars`` count within the sequence; a TMA box of it starts at ``[coord_batch, head, origin + row, 0]``.
        Dense: ``(batch, 0, 0, ..)``.  VARLEN (a packed sequence, descriptors over ``[1, H, total, D]``): ``(0,
        cu_seqlens_q[b], cu_seqlens_k[b], total_q, ..)``; lse is ``[H, total_q]``, a slab of rows cut by the
        sequence's end leaves by masked stores from shared memory (a TMA box would write the next sequence's rows), and
        (INLINE_LOADS) the warpgroup zeroes the rows of its last V tile past the sequence (``zero_rows_from``; the
        producer warp does it otherwise).
        """
        q_smem, q2_smem, k_ring, k2_ring, v_ring, o_smem, p_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, q_empty = bars
        (bh, _, head, kv_head, start_m, seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles,
         qk_scale, q_phase, q_set_base, q_release, kv_base, o_factor) = scalars  # fmt: skip
        window_left, window_right, cap_in, cap_out, slope2 = modifiers
        coord_batch, row_origin, key_origin, total_q, o_ptr, stride_o_row = packed
        FIXED_MAX: gl.constexpr = SOFTCAP == _SOFTCAP_FIXED_MAX
        # (SOFTCAP == 2 is the hardware tanh in ScoreModifiers' flags: here only softcap_form's value means this.)
        gl.static_assert(not (FIXED_MAX and (IS_FP16 or DESCALE or ALIBI)), "the fixed max: bfloat16 without ALiBi")
        ROWS: gl.constexpr = q_smem.type.shape[3]
        DTYPE: gl.constexpr = gl.float8e4nv if DESCALE else (gl.float16 if IS_FP16 else gl.bfloat16)
        O_DTYPE: gl.constexpr = gl.bfloat16 if DESCALE else DTYPE
        OPERAND_BITS: gl.constexpr = 8 if DESCALE else 16
        # Accumulator layouts of the two products (one warpgroup: a thread holds 2 of the 64 rows).
        s_layout: gl.constexpr = accumulator_layout(4, BLOCK_N, OPERAND_BITS)
        o_layout: gl.constexpr = accumulator_layout(4, BLOCK_DV, OPERAND_BITS)
        # A 16-bit P goes from the S accumulator's registers straight into P V as its register operand (no shared
        # memory); an FP8 one through shared memory (_stage_p), in slots 2 * WARPGROUP + (tile % 2).
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        flip = False
        if DESCALE:
            flip = qk_scale < 0.0
            # |qk_scale|, at least float32's smallest normal: the masks' -inf times a zero factor would be NaN, and
            # a zero factor's scores (|s| < 448^2 * 256 < 2^26) scaled by 2^-126 still give exp2 = 1 (all equal).
            qk_scale = gl.maximum(gl.maximum(qk_scale, -qk_scale), 1.1754943508222875e-38)
        start_m = start_m + WARPGROUP * ROWS
        diagonal_offset = seqlen_k - seqlen_q
        alibi_origin = start_m + diagonal_offset  # r0 of _modified_scores: this warpgroup's first row's position
        rows = start_m + gl.arange(0, ROWS, s_rows)
        local_keys = gl.arange(0, BLOCK_N, s_cols)
        alibi_local = slope2 * local_keys.to(gl.float32)
        q_slot = WARPGROUP + q_set_base
        q_rows = q_smem.index(q_slot)
        mbarrier.wait(q_bars.index(q_slot), q_phase)
        q_tile = q_rows.reshape([ROWS, BLOCK_D])
        if BLOCK_D2 > 0:
            q2_tile = q2_smem.index(q_slot).reshape([ROWS, BLOCK_D2])
        else:
            q2_tile = q_tile  # not read

        # Tile 0: nothing to overlap with yet.
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        s = _issue_scores(q_tile, q2_tile, k_ready, k_ring, k2_ring, kv_base, s, BLOCK_N, BLOCK_D, BLOCK_D2, NUM_STAGES)
        if DEFER_O_WAIT:  # noqa: SIM102 - a compile-time branch around a runtime one
            # The previous block's O store reads its Q slot while this block's first S product runs; only then is
            # the slot released to the producer.
            if q_release >= 0:
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(q_release))
        s = warpgroup_mma_wait(0, deps=(s,))
        if not INLINE_LOADS:
            mbarrier.arrive(k_empty.index(kv_base % NUM_STAGES))
        s = _signed_scores(s, flip, DESCALE)
        keys = first_key + local_keys
        step_scale = qk_scale
        tanh_scale = softcap_tanh_scale(qk_scale, cap_in)
        if ALIBI:
            alibi_cols = alibi_key_term(alibi_local, first_key, alibi_origin, slope2, CAUSAL, ALIBI)
            s = _modified_scores(
                s, rows, keys, diagonal_offset, alibi_cols, qk_scale, cap_in, cap_out, slope2, CAUSAL, SOFTCAP, ALIBI
            )  # fmt: skip
            step_scale = 1.0
        elif SOFTCAP:
            # The soft cap alone: the tile holds t = tanh(s / c), and the softmax scales it by cap_out (> 0) as it
            # scales raw scores by qk_scale, so the capped score c * tanh costs no multiply of its own (exp2's FFMA
            # takes it) and the max runs over t.
            s = tanh_approx(s * tanh_scale)
            step_scale = cap_out
        if (unmasked_tiles == 0) | (left_tiles > 0):
            s = mask_scores(
                s, rows, keys, diagonal_offset, seqlen_k, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT
            )
        l_i = gl.zeros([ROWS], gl.float32, s_rows)
        if FIXED_MAX:
            m_i = gl.full([ROWS], 0.0, gl.float32, s_rows) + cap_out  # the max of every tile, for lse at the end
            p, l_i = _capped_softmax_step(s, l_i, cap_out, DTYPE, p_layout)
        else:
            m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, step_scale, DTYPE, p_layout, not DESCALE)
        _stage_p(p, p_smem, 2 * WARPGROUP, DESCALE)
        if DESCALE:
            cta_barrier()
        acc = gl.zeros([ROWS, BLOCK_DV], gl.float32, o_layout)

        for j in range(1, n_tiles):
            if INLINE_LOADS:
                # Every warp is past iteration j-1, so K slot j-1 (S_{j-1} waited) and V slot j-2 (P V waited) are
                # free: refill them with the tiles NUM_STAGES - 1 iterations ahead.
                cta_barrier()
                k_next = j + NUM_STAGES - 1
                v_next = j + NUM_STAGES - 2
                first = key_origin + first_key
                _load_qk(k_desc, k2_desc, k_ready, k_ring, k2_ring, k_next, coord_batch, kv_head,
                         first + k_next * BLOCK_N, k_next < n_tiles, NUM_STAGES, BLOCK_D2 > 0)  # fmt: skip
                _load_v(v_desc, v_ready, v_ring, v_next, coord_batch, kv_head, first + v_next * BLOCK_N,
                        v_next < n_tiles, NUM_STAGES, DESCALE)  # fmt: skip

            # The last S tile's registers serve as the (ignored) accumulator input: no zero tile per iteration.
            s = _issue_scores(
                q_tile, q2_tile, k_ready, k_ring, k2_ring, kv_base + j, s, BLOCK_N, BLOCK_D, BLOCK_D2, NUM_STAGES
            )
            if not FIXED_MAX:
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            v_tile = _wait_v(v_ready, v_ring, kv_base + j - 1, BLOCK_N, BLOCK_DV, NUM_STAGES, DESCALE)
            acc = warpgroup_mma(_p_operand(p, p_smem, 2 * WARPGROUP + (j - 1) % 2, DESCALE), v_tile, acc, is_async=True)
            # wgmma groups complete in order: one outstanding means S_j (both parts) is done and P_{j-1} V_{j-1} may
            # still run.
            s = warpgroup_mma_wait(1, deps=(s,))
            if not INLINE_LOADS:
                # A wgmma is one operation of the whole warpgroup: once it is complete in this thread, it has read
                # its shared memory for all four warps, so one arrive per warpgroup frees the slot.
                mbarrier.arrive(k_empty.index((kv_base + j) % NUM_STAGES))
            s = _signed_scores(s, flip, DESCALE)
            keys = first_key + j * BLOCK_N + local_keys
            if ALIBI:
                alibi_cols = alibi_key_term(alibi_local, first_key + j * BLOCK_N, alibi_origin, slope2, CAUSAL, ALIBI)
                s = _modified_scores(
                    s, rows, keys, diagonal_offset, alibi_cols, qk_scale, cap_in, cap_out, slope2, CAUSAL, SOFTCAP,
                    ALIBI,
                )  # fmt: skip
            elif SOFTCAP:
                s = tanh_approx(s * tanh_scale)
            if (j >= unmasked_tiles) | (j < left_tiles):
                s = mask_scores(
                    s, rows, keys, diagonal_offset, seqlen_k, window_left, window_right, CAUSAL, WINDOW_LEFT,
                    WINDOW_RIGHT,
                )  # fmt: skip
            if FIXED_MAX:
                p_next, l_i = _capped_softmax_step(s, l_i, cap_out, DTYPE, p_layout)
            else:
                p_next, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, step_scale, DTYPE, p_layout, not DESCALE)
            _stage_p(p_next, p_smem, 2 * WARPGROUP + j % 2, DESCALE)  # the slot P_{j-2} V_{j-2} read
            if DESCALE:
                acc = warpgroup_mma_wait(0, deps=(acc,))
                cta_barrier()  # every warp's rows of P_j are in place, and every warp is done with P_{j-1}'s slot
            else:
                # P_{j-1} stays alive (the product reads it from registers) until this wait.
                acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            if not INLINE_LOADS:
                mbarrier.arrive(v_empty.index((kv_base + j - 1) % NUM_STAGES))
            p = p_next

        if not FIXED_MAX:
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        v_tile = _wait_v(v_ready, v_ring, kv_base + n_tiles - 1, BLOCK_N, BLOCK_DV, NUM_STAGES, DESCALE)
        if VARLEN and INLINE_LOADS:  # only the last tile can reach past the sequence: the others end before `end`
            _zero_tail(v_tile, seqlen_k - (first_key + (n_tiles - 1) * BLOCK_N))
        acc = warpgroup_mma(_p_operand(p, p_smem, 2 * WARPGROUP + (n_tiles - 1) % 2, DESCALE), v_tile, acc,
                            is_async=True)  # fmt: skip
        if DESCALE:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        else:
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        if not INLINE_LOADS:
            # The last V slot too: a persistent producer refills it for its next Q block.
            mbarrier.arrive(v_empty.index((kv_base + n_tiles - 1) % NUM_STAGES))

        # Rows with no visible key: l = 0, acc = 0 (m = -inf, or cap_out under FIXED_MAX) -> o = 0, lse = -inf (no NaN).
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse2 = m_i + gl.log2(l_safe)
        if ALIBI and CAUSAL:  # the row's constant that _modified_scores left in its scores: slope (i' - r0)
            lse2 = lse2 - slope2 * (rows - start_m).to(gl.float32)
        lse = gl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
        o_scale = 1.0 / l_safe
        if DESCALE:  # P V summed the stored values of v: the real ones are o_factor times them
            o_scale = o_scale * o_factor
        o_tile = acc * gl.convert_layout(o_scale, o_rows)[:, None]
        # O leaves through shared memory (this warpgroup's Q rows when Dv = D, which the products no longer read):
        # one TMA store (rows past Nq are dropped by the copy engine), or, for a slab that the end of a packed
        # sequence cuts, masked stores of its own rows.
        if BLOCK_DV == BLOCK_D and not DESCALE:  # o_smem is q_smem (the kernel's allocation): this block's Q slot
            o_slot = o_smem.index(q_slot)
        else:  # O's own slots, one a warpgroup
            o_slot = o_smem.index(WARPGROUP)
        cta_barrier()  # every warp is past the waits of the products that read Q
        o_slot.reshape([ROWS, BLOCK_DV]).store(o_tile.to(O_DTYPE))
        fence_async_shared()
        cta_barrier()
        if VARLEN:
            # (a compile-time branch around the cut: Triton 3.6 fails to lower these masked stores under a run-time
            # `if` whose condition is constant false)
            lse_rows = lse_ptr + head.to(gl.int64) * total_q + row_origin
            if start_m + ROWS > seqlen_q:
                o_head = o_ptr + (row_origin + start_m).to(gl.int64) * stride_o_row + head * BLOCK_DV
                store_rows_below(o_slot.reshape([ROWS, BLOCK_DV]), o_head, stride_o_row, seqlen_q - start_m, 4)
            else:
                tma_store(o_desc, [coord_batch, head, row_origin + start_m, 0], o_slot)
        else:
            lse_rows = lse_ptr + bh.to(gl.int64) * seqlen_q
            tma_store(o_desc, [coord_batch, head, start_m, 0], o_slot)
        gl.store(lse_rows + rows, lse, mask=rows < seqlen_q)
        if not DEFER_O_WAIT:
            tma.store_wait(0)

    @gluon.jit
    def _load_q_rows(q_desc, q2_desc, q_smem, q2_smem, q_bars, q_empty, batch, head, start_m, q_round,
                     NUM_WARPGROUPS: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        """A persistent producer: each warpgroup's Q rows of round ``q_round`` into its slot of that round, once the
        O of the slot's last round has left through it.  Warpgroup ``w``'s slot ``w + NUM_WARPGROUPS * (r % Q_SETS)``
        serves rounds ``r, r + Q_SETS, ..``, so its ``n``-th use is round ``n * Q_SETS + r % Q_SETS`` and waits for
        phase ``n - 1`` of its ``q_empty`` barrier (an mbarrier starts as if phase "-1" had completed)."""
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        TOTAL_SLOTS: gl.constexpr = q_smem.type.shape[0]
        Q_SETS: gl.constexpr = TOTAL_SLOTS // NUM_WARPGROUPS
        set_base = NUM_WARPGROUPS * (q_round % Q_SETS)
        for w in gl.static_range(NUM_WARPGROUPS):
            mbarrier.wait(q_empty.index(w + set_base), ((q_round // Q_SETS) & 1) ^ 1)
            _load_qk(q_desc, q2_desc, q_bars, q_smem, q2_smem, w + set_base, batch, head, start_m + w * ROWS, True,
                     TOTAL_SLOTS, SPLIT)  # fmt: skip

    @gluon.jit
    def _load_tiles(
        q_desc, k_desc, q2_desc, k2_desc, v_desc, smem, bars, q_empty, batch, head, kv_head, start_m, first_key,
        n_tiles, kv_base, q_round, key_end, v_tail,
        BLOCK_N: gl.constexpr, BLOCK_D2: gl.constexpr, NUM_WARPGROUPS: gl.constexpr, NUM_STAGES: gl.constexpr,
        PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, KEYS_INNER: gl.constexpr,
    ):  # fmt: skip
        """The producer warp of the warp-specialised block: each warpgroup's Q rows, then K and V tile ``i`` (ring
        number ``kv_base + i``) into its slot as soon as every warpgroup has released the slot's previous tile.

        PERSISTENT (Q block number ``q_round`` of this program): a warpgroup's Q rows of round ``r`` go into slot
        ``w + NUM_WARPGROUPS * (r % Q_SETS)`` once it has stored the O of round ``r - Q_SETS`` through that slot
        (``q_empty``).  With one slot per warpgroup that is the previous block's, so they are loaded after this
        block's first K/V tile, whose copy then overlaps the previous block's epilogue; with two, before it, while
        the warpgroups still run the previous block's last tiles.

        ``batch``, ``start_m`` and ``first_key`` are TMA coordinates (packed: 0 and rows of the whole tensor).
        VARLEN: a V tile that reaches past the sequence's last key ``key_end`` lands on ``v_tail`` instead; this warp
        zeroes its rows past the sequence (``zero_rows_from``) and only then completes the slot's "ready" barrier
        (a plain arrive: its count is one and no bytes are expected of it).  KEYS_INNER: v's boxes are ``[Dv,
        BLOCK_N]`` (FP8, ``_load_v``)."""
        q_smem, q2_smem, k_ring, k2_ring, v_ring, _, _ = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, _ = bars
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        Q_SETS: gl.constexpr = q_smem.type.shape[0] // NUM_WARPGROUPS
        if not PERSISTENT:
            for w in gl.static_range(NUM_WARPGROUPS):
                _load_qk(q_desc, q2_desc, q_bars, q_smem, q2_smem, w, batch, head, start_m + w * ROWS, True,
                         NUM_WARPGROUPS, BLOCK_D2 > 0)  # fmt: skip
        elif Q_SETS > 1:
            _load_q_rows(q_desc, q2_desc, q_smem, q2_smem, q_bars, q_empty, batch, head, start_m, q_round,
                         NUM_WARPGROUPS, BLOCK_D2 > 0)  # fmt: skip
        for i in range(n_tiles):
            index = kv_base + i
            slot = index % NUM_STAGES
            # An mbarrier starts as if its phase "-1" had completed, so the waits of the first round pass at once.
            free_phase = ((index // NUM_STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free_phase)
            _load_qk(k_desc, k2_desc, k_ready, k_ring, k2_ring, index, batch, kv_head, first_key + i * BLOCK_N, True,
                     NUM_STAGES, BLOCK_D2 > 0)  # fmt: skip
            mbarrier.wait(v_empty.index(slot), free_phase)
            key = first_key + i * BLOCK_N
            if VARLEN and key + BLOCK_N > key_end:  # at most one such tile: the block's last (v_tail's phase 0)
                mbarrier.expect(v_tail, v_desc.block_type.nbytes)
                tma_load(v_desc, [batch, kv_head, key, 0], v_tail, v_ring.index(slot))
                mbarrier.wait(v_tail, 0)
                v_tile = v_ring.index(slot)
                zero_rows_from(v_tile.reshape([v_tile.type.shape[2], v_tile.type.shape[3]]), key_end - key, 1)
                mbarrier.arrive(v_ready.index(slot))
            else:
                _load_v(v_desc, v_ready, v_ring, index, batch, kv_head, key, True, NUM_STAGES, KEYS_INNER)
            if PERSISTENT and Q_SETS == 1:  # noqa: SIM102 - a compile-time branch around a runtime one
                if i == 0:
                    _load_q_rows(q_desc, q2_desc, q_smem, q2_smem, q_bars, q_empty, batch, head, start_m, q_round,
                                 NUM_WARPGROUPS, BLOCK_D2 > 0)  # fmt: skip

    @gluon.jit
    def q_block_tiles(
        tile, problem, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """Q block ``tile`` of the grid (``q_block_opening``'s numbering) -> ``(bh, batch, head, kv_head, start_m,
        start, left_tiles, unmasked_tiles, n_tiles, slope2, seqlen_q, seqlen_k, packed)`` with ``packed`` as
        ``_attend_rows`` takes it.  VARLEN: ``batch`` is the sequence, the lengths are its own, and ``start_m >=
        seqlen_q`` marks an idle slot of the grid (``common.varlen_block``).

        Key ranges (kv_loop_bounds, as in forward.py): the loop runs over the tiles of [start, end), and
        [unmasked_start, unmasked_end) needs no mask; tiles outside [start, end) are hidden from every real row and
        never loaded.  At least one tile runs (fully masked when no row sees a key), so that the loop needs no
        special case: it leaves m = -inf, l = 0 in such rows."""
        (num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k, window_left, window_right,
         alibi_ptr, stride_alibi_b, stride_alibi_h, varlen, outputs) = problem  # fmt: skip
        total_q, o_ptr, stride_o_row = outputs
        if VARLEN:
            # (alibi_ptr stands in for seqlens_k, which the scope excludes)
            bh, _, batch, head, kv_head, start_m, q_first, k_first, seqlen_q, seqlen_k, _ = q_block_opening(
                tile, num_m_blocks, num_heads, group_size, alibi_ptr, seqlen_q, seqlen_k, varlen, BLOCK_M, CAUSAL,
                False, True,
            )  # fmt: skip
            packed = (0, q_first, k_first, total_q, o_ptr, stride_o_row)
        else:
            bh, m_block, batch, head, kv_head = q_block_program(tile, num_m_blocks, num_heads, group_size, CAUSAL)
            start_m = m_block * BLOCK_M
            packed = (batch, 0, 0, total_q, o_ptr, stride_o_row)
        start, unmasked_start, unmasked_end, end = kv_loop_bounds(
            start_m, seqlen_q, seqlen_k, seqlen_k, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        left_tiles = (unmasked_start - start) // BLOCK_N
        unmasked_tiles = (unmasked_end - start) // BLOCK_N
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)
        if ALIBI:
            slope = gl.load(alibi_ptr + batch.to(gl.int64) * stride_alibi_b + head.to(gl.int64) * stride_alibi_h)
            slope2 = slope * 1.4426950408889634
        else:
            slope2 = 0.0
        return (bh, batch, head, kv_head, start_m, start, left_tiles, unmasked_tiles, n_tiles, slope2, seqlen_q,
                seqlen_k, packed)  # fmt: skip

    @gluon.jit
    def _round_tile(tile, num_tiles, CAUSAL: gl.constexpr):
        """The Q block a persistent program computes at grid position ``tile`` (``program_id + k * num_programs``):
        with a causal mask, every odd round of ``num_programs`` tiles is taken in reverse.

        The grid numbers a head's blocks longest first (``q_block_program``), and a round of 132 programs over
        8 blocks per head (N = 1k) gives program p the blocks ``7 - p % 8`` and ``7 - (p + 4) % 8`` in turn: 12 K/V
        tiles per two blocks for some programs, 6 for others, and the round waits for the longest.  Reversing odd
        rounds pairs a long block with a short one (``m`` then about ``7 - m``): in a model of the schedule the
        busiest program's tiles fall from 1.38x the mean to 1.03x at N = 1k (1.21x to 1.03x at 2k).  A round still
        covers the same consecutive tiles, so the same heads' K/V are in L2."""
        if CAUSAL:
            programs = gl.num_programs(0)
            round_index = tile // programs
            if round_index % 2 == 1:
                first = round_index * programs
                size = gl.minimum(programs, num_tiles - first)
                tile = first + size - 1 - (tile - first)
        return tile

    @gluon.jit
    def _attend_blocks(
        k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, q_empty, problem, num_tiles, qk_scale, cap_in, cap_out,
        WARPGROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
        BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    ):  # fmt: skip
        """A persistent program's warpgroup ``WARPGROUP``: its rows of Q blocks ``program_id, program_id +
        num_programs, ..``, one after the other, each as ``_attend_rows``; once a block's O has left through its Q
        slot, an arrive on the slot's ``q_empty`` lets the producer load a later block's rows into it.  With one set
        of Q slots, the arrive follows the block, and the next block's rows load into the slot; with two, the next
        block makes it right after issuing its first S product (``DEFER_O_WAIT``), and the block after that loads
        into the slot (the next block's rows loaded into the other set meanwhile)."""
        window_left, window_right = problem[5], problem[6]
        Q_SETS: gl.constexpr = smem[0].type.shape[0] // 2  # (a persistent block has two warpgroups)
        kv_base = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            q_round = (tile - gl.program_id(0)) // gl.num_programs(0)
            q_set_base = 2 * (q_round % Q_SETS)  # the first slot of this round's set
            (bh, batch, head, kv_head, start_m, start, left_tiles, unmasked_tiles, n_tiles, slope2, seqlen_q,
             seqlen_k, packed) = q_block_tiles(_round_tile(tile, num_tiles, CAUSAL), problem, 128, BLOCK_N, CAUSAL,
                                          WINDOW_LEFT, WINDOW_RIGHT, ALIBI, False)  # fmt: skip
            # With two sets, the previous block's slot is released inside this block, once its first S is issued.
            q_release = -1
            if q_round > 0:
                q_release = WARPGROUP + 2 * ((q_round - 1) % Q_SETS)
            scalars = (bh, batch, head, kv_head, start_m, seqlen_q, seqlen_k, start, left_tiles, unmasked_tiles,
                       n_tiles, qk_scale, (q_round // Q_SETS) & 1, q_set_base, q_release, kv_base, 1.0)  # fmt: skip
            _attend_rows(k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, scalars,
                         (window_left, window_right, cap_in, cap_out, slope2), packed,
                         WARPGROUP, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, NUM_STAGES, IS_FP16, False,
                         WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, False, False, Q_SETS == 2)  # fmt: skip
            if Q_SETS == 1:
                mbarrier.arrive(q_empty.index(WARPGROUP + q_set_base))
            kv_base += n_tiles
        tma.store_wait(0)  # the last block's O (DEFER_O_WAIT)

    @gluon.jit
    def _load_blocks(
        q_desc, k_desc, q2_desc, k2_desc, v_desc, smem, bars, q_empty, problem, num_tiles,
        BLOCK_N: gl.constexpr, BLOCK_D2: gl.constexpr, NUM_WARPGROUPS: gl.constexpr, NUM_STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    ):  # fmt: skip
        """A persistent program's producer warp: the tiles of its Q blocks in the order its warpgroups use them."""
        kv_base = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            q_round = (tile - gl.program_id(0)) // gl.num_programs(0)
            _, batch, head, kv_head, start_m, start, _, _, n_tiles, _, _, seqlen_k, _ = q_block_tiles(
                _round_tile(tile, num_tiles, CAUSAL), problem, 128, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, False,
                False,
            )  # fmt: skip
            _load_tiles(q_desc, k_desc, q2_desc, k2_desc, v_desc, smem, bars, q_empty, batch, head, kv_head,
                        start_m, start, n_tiles, kv_base, q_round, seqlen_k, q_empty, BLOCK_N, BLOCK_D2,
                        NUM_WARPGROUPS, NUM_STAGES, True, False, False)  # fmt: skip
            kv_base += n_tiles

    @gluon.jit(do_not_specialize=[
        "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "window_left", "window_right",
        "stride_alibi_b", "stride_alibi_h", "num_tiles", "total_q", "num_sequences", "search_steps",
    ])  # fmt: skip
    def attention_forward_hopper_kernel(
        q_desc, k_desc, q2_desc, k2_desc, v_desc, o_desc, lse_ptr,
        num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, qk_scale,
        window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h, num_tiles,
        o_ptr, stride_o_row, total_q, cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps, descale_ptr,
        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr,
        CAUSAL: gl.constexpr, NUM_WARPGROUPS: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
        PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, DESCALE: gl.constexpr, Q_SETS: gl.constexpr,
    ):  # fmt: skip
        """o, lse of one Q block of NUM_WARPGROUPS * 64 rows of one (batch, head); grid: 1-d, ``num_tiles`` =
        num_m_blocks * B * H programs (as ``forward.py``); launched with 4 warps (the first warpgroup; the
        warp-specialised block adds the second warpgroup and the producer warp as worker partitions).  PERSISTENT
        (warp-specialised blocks only): fewer programs, each running Q blocks ``program_id + k * num_programs`` in
        turn, the K/V rings' slots and phases carried from one block to the next, with Q_SETS (1 or 2,
        ``persistent_q_sets``) sets of Q slots: with 2, the next block's Q rows load while this block runs.

        Descriptors are 4-d over ``[B, H, N, D]``, with ``[1, 1, 64, D]`` boxes for q/o and ``[1, 1, BLOCK_N, D]``
        for k/v (v and o: ``Dv`` = BLOCK_DV for D): a box past N reads zeros and a store past Nq is dropped, so the
        tails need no predicates.  Tiles have power-of-two widths, so a head dim such as 192 comes as two column
        parts: q_desc/k_desc over columns ``[0, BLOCK_D)`` and q2_desc/k2_desc over the next BLOCK_D2 (0: no second
        part; q2_desc/k2_desc are then q_desc/k_desc again, unread).

        VARLEN (a packed batch; not PERSISTENT): the descriptors are over ``[1, H, total, D]`` views of the packed
        ``[total, H, D]`` tensors, the grid is ``num_m_blocks = total_q // BLOCK_M + B`` slots per head
        (``common.varlen_block``; idle slots return at once), ``o_ptr``/``stride_o_row`` address the packed o for
        the rows a TMA box may not write, and lse is ``[H, total_q]``.

        DESCALE (FP8 inputs, ``attnzoo.attention_fp8``; dense, not PERSISTENT, one column part): q, k, v are e4m3,
        ``descale_ptr`` is float32 ``[B, Hkv, 3]`` (the factors of q, k and v), o is bfloat16, and ``v_desc`` is over
        the keys-contiguous ``[B, Hkv, Dv, Nk]`` view of v with ``[1, 1, Dv, BLOCK_N]`` boxes.

        SOFTCAP: 0, SOFTCAP_RUNNING_MAX or SOFTCAP_FIXED_MAX (``softcap_form``); the soft cap is always the hardware's
        ``tanh.approx.f32``.
        """
        DTYPE: gl.constexpr = gl.float8e4nv if DESCALE else (gl.float16 if IS_FP16 else gl.bfloat16)
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        gl.static_assert(ROWS == 64, "q/o boxes of one warpgroup's 64 rows")
        BLOCK_M: gl.constexpr = ROWS * NUM_WARPGROUPS
        gl.static_assert(not (VARLEN and PERSISTENT), "a packed batch runs one Q block per program")
        problem = (num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k, window_left, window_right,
                   alibi_ptr, stride_alibi_b, stride_alibi_h, (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps),
                   (total_q, o_ptr, stride_o_row))  # fmt: skip
        (bh, batch, head, kv_head, start_m, start, left_tiles, unmasked_tiles, n_tiles, slope2, seqlen_q, seqlen_k,
         packed) = q_block_tiles(gl.program_id(0), problem, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, ALIBI,
                            VARLEN)  # fmt: skip
        if VARLEN:  # noqa: SIM102 - a compile-time branch around a runtime one
            if start_m >= seqlen_q:  # an idle slot of the packed grid
                return
        coord_batch, row_origin, key_origin = packed[0], packed[1], packed[2]
        if DESCALE:
            gl.static_assert(not (VARLEN or PERSISTENT or BLOCK_D2 > 0), "FP8: dense calls, one column part")
            q_factor, k_factor, o_factor = fp8_factors(descale_ptr, batch, kv_head, num_heads // group_size)
            qk_scale = qk_scale * q_factor * k_factor
        else:
            o_factor = 1.0

        gl.static_assert(Q_SETS == 1 or PERSISTENT, "a block per program loads its Q rows once")
        # Q_SETS sets of Q slots, one slot a warpgroup each: a persistent program's block r uses set r % Q_SETS.
        q_smem = gl.allocate_shared_memory(DTYPE, [NUM_WARPGROUPS * Q_SETS, 1, 1, ROWS, BLOCK_D], q_desc.layout)
        k_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
        if BLOCK_D2 > 0:
            q2_smem = gl.allocate_shared_memory(DTYPE, [NUM_WARPGROUPS * Q_SETS, 1, 1, ROWS, BLOCK_D2], q2_desc.layout)
            k2_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D2], k2_desc.layout)
        else:
            q2_smem = q_smem
            k2_ring = k_ring
        if DESCALE:
            v_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_DV, BLOCK_N], v_desc.layout)
        else:
            v_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_DV], v_desc.layout)
        if BLOCK_DV == BLOCK_D and not DESCALE:
            o_smem = q_smem  # O leaves through the Q rows
        else:
            o_smem = gl.allocate_shared_memory(
                o_desc.block_type.element_ty, [NUM_WARPGROUPS, 1, 1, ROWS, BLOCK_DV], o_desc.layout
            )
        if DESCALE:  # two P slots per warpgroup (_stage_p)
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], DTYPE)
            p_smem = gl.allocate_shared_memory(DTYPE, [2 * NUM_WARPGROUPS, ROWS, BLOCK_N], p_layout)
        else:
            p_smem = q_smem  # not used
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_WARPGROUPS * Q_SETS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        if PERSISTENT:
            q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WARPGROUPS * Q_SETS, 1], mbarrier.MBarrierLayout())
        else:
            q_empty = q_bars  # not used
        if VARLEN and NUM_WARPGROUPS == 2:
            v_tail = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(v_tail, count=1)
        else:
            v_tail = q_bars.index(0)  # not used
        for w in gl.static_range(NUM_WARPGROUPS * Q_SETS):
            mbarrier.init(q_bars.index(w), count=1)
            if PERSISTENT:
                mbarrier.init(q_empty.index(w), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WARPGROUPS)  # one arrive per warpgroup frees a slot
            mbarrier.init(v_empty.index(i), count=NUM_WARPGROUPS)
        fence_async_shared()

        smem = (q_smem, q2_smem, k_ring, k2_ring, v_ring, o_smem, p_smem)
        bars = (q_bars, k_ready, v_ready, k_empty, v_empty, q_empty)
        scalars = (
            bh,
            batch,
            head,
            kv_head,
            start_m,
            seqlen_q,
            seqlen_k,
            start,
            left_tiles,
            unmasked_tiles,
            n_tiles,
            qk_scale,
            0,  # q_phase
            0,  # q_set_base
            -1,  # q_release
            0,  # kv_base
            o_factor,
        )
        modifiers = (window_left, window_right, cap_in, cap_out, slope2)
        if NUM_WARPGROUPS == 1:
            # Prologue loads: Q, K tiles 0 .. NUM_STAGES-1, V tiles 0 .. NUM_STAGES-2 (V slot NUM_STAGES-1 is filled
            # at the top of iteration 1, when the refill schedule of _attend_rows takes over).
            _load_qk(q_desc, q2_desc, q_bars, q_smem, q2_smem, 0, coord_batch, head, row_origin + start_m, True, 1,
                     BLOCK_D2 > 0)  # fmt: skip
            first = key_origin + start
            for i in gl.static_range(NUM_STAGES):
                _load_qk(k_desc, k2_desc, k_ready, k_ring, k2_ring, i, coord_batch, kv_head, first + i * BLOCK_N,
                         i < n_tiles, NUM_STAGES, BLOCK_D2 > 0)  # fmt: skip
            for i in gl.static_range(NUM_STAGES - 1):
                _load_v(v_desc, v_ready, v_ring, i, coord_batch, kv_head, first + i * BLOCK_N, i < n_tiles,
                        NUM_STAGES, DESCALE)  # fmt: skip
            _attend_rows(k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, scalars, modifiers, packed,
                         0, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, NUM_STAGES, IS_FP16, True,
                         WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, VARLEN, DESCALE)  # fmt: skip
        elif PERSISTENT:
            gl.static_assert(NUM_WARPGROUPS == 2, "persistent blocks are warp-specialised")
            gl.warp_specialize(
                [
                    (_attend_blocks, (k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, q_empty, problem,
                                      num_tiles, qk_scale, cap_in, cap_out, 0, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV,
                                      CAUSAL, NUM_STAGES, IS_FP16, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI)),
                    (_attend_blocks, (k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, q_empty, problem,
                                      num_tiles, qk_scale, cap_in, cap_out, 1, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV,
                                      CAUSAL, NUM_STAGES, IS_FP16, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI)),
                    (_load_blocks, (q_desc, k_desc, q2_desc, k2_desc, v_desc, smem, bars, q_empty, problem, num_tiles,
                                    BLOCK_N, BLOCK_D2, NUM_WARPGROUPS, NUM_STAGES, CAUSAL, WINDOW_LEFT,
                                    WINDOW_RIGHT)),
                ],
                [4, 1],
                [232, 24],
            )  # fmt: skip
        else:
            gl.static_assert(NUM_WARPGROUPS == 2, "one or two warpgroups per Q block")
            # Constexpr arguments go to the partitions as literals: a constexpr held in a variable would reach a
            # worker partition as a runtime value in Triton 3.6.  The third list is each worker partition's register
            # count, set by `setmaxnreg` once the partitions start: the second computing warpgroup rises to 232, the
            # producer warp's warpgroup (padded to four warps) drops to 24, and the default partition takes what is
            # left, 248 (the launch count that ptxas reports is 168, 65536 over 384 threads).
            gl.warp_specialize(
                [
                    (_attend_rows, (k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, scalars, modifiers, packed,
                                    0, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, NUM_STAGES, IS_FP16, False,
                                    WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, VARLEN, DESCALE)),
                    (_attend_rows, (k_desc, k2_desc, v_desc, o_desc, lse_ptr, smem, bars, scalars, modifiers, packed,
                                    1, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, NUM_STAGES, IS_FP16, False,
                                    WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, VARLEN, DESCALE)),
                    (_load_tiles, (q_desc, k_desc, q2_desc, k2_desc, v_desc, smem, bars, q_empty, coord_batch, head,
                                   kv_head, row_origin + start_m, key_origin + start, n_tiles, 0, 0,
                                   key_origin + seqlen_k, v_tail, BLOCK_N, BLOCK_D2, NUM_WARPGROUPS, NUM_STAGES,
                                   False, VARLEN, DESCALE)),
                ],
                [4, 1],
                [232, 24],
            )  # fmt: skip

        for w in gl.static_range(NUM_WARPGROUPS * Q_SETS):
            mbarrier.invalidate(q_bars.index(w))
            if PERSISTENT:
                mbarrier.invalidate(q_empty.index(w))
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_empty.index(i))
        if VARLEN and NUM_WARPGROUPS == 2:
            mbarrier.invalidate(v_tail)


def softcap_form(modifiers: ScoreModifiers, dtype: torch.dtype) -> int:
    """The Gluon forward's SOFTCAP for a call: 0 without a soft cap; SOFTCAP_FIXED_MAX where every score's bound
    makes the running max unneeded (``_capped_softmax_step``): bfloat16 inputs (an FP8 or float16 P cannot hold
    ``2^(-2 cap_out)``), no ALiBi (its terms can lift a score above the cap), ``cap_out <= FIXED_MAX_CAP_OUT``;
    else SOFTCAP_RUNNING_MAX."""
    if not modifiers.softcap:
        return 0
    if dtype == torch.bfloat16 and not modifiers.alibi and modifiers.cap_out <= FIXED_MAX_CAP_OUT:
        return SOFTCAP_FIXED_MAX
    return SOFTCAP_RUNNING_MAX


@functools.cache  # (asked on every persistent launch: the host path of a repeated call stays a lookup)
def persistent_q_sets(d: int, dv: int, block_n: int, num_stages: int, itemsize: int, limit: int) -> int:
    """Sets of Q slots (one slot a warpgroup each) of a persistent 128-row block: 2 where a second set (the next
    block's Q rows, loading while this one runs) fits the shared memory beside the K/V rings, else 1 (the next
    block's Q rows load only once this block's O has left through them).  ``d`` is q's whole head dim (both column
    parts), ``limit`` the bytes a CTA may hold."""
    tile = KernelConfig(128, block_n, 8, num_stages, gluon=True, persistent=True)
    one_set = gluon_shared_memory_estimate("forward", tile, d, dv, itemsize)
    overhead = 1024  # the mbarriers (about 130 B), what the partitions are passed, alignment
    return 2 if one_set + itemsize * 128 * d + overhead <= limit else 1


def attention_forward_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    modifiers: ScoreModifiers,
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    persistent: bool = False,
    varlen: tuple | None = None,
    descale: torch.Tensor | None = None,
    launch_key: tuple | None = None,
) -> None:
    """Write ``o`` ``[B, H, Nq, Dv]`` (contiguous, dtype of q; bfloat16 for FP8 inputs) and ``lse`` ``[B, H, Nq]``
    float32 of one call.

    ``q`` ``[B, H, Nq, D]``, ``k`` ``[B, Hkv, Nk, D]``, ``v`` ``[B, Hkv, Nk, Dv]`` (D: a power of two or the sum of
    two, ``head_dim_parts``; Dv: a power of two), in the scope that
    ``KernelVariant.FORWARD.gluon_scope`` (``launch.py``) checks.  ``block_m`` = 64 (one warpgroup, ``num_warps`` = 4)
    or 128 (two warpgroups, ``num_warps`` = 8, warp-specialised with a producer warp).  ``persistent`` (128 rows):
    one program per SM (fewer where there are fewer Q blocks) runs the Q blocks in turn, each block's first K/V tile
    loading under the previous one's epilogue, and where the shared memory holds two sets of Q rows
    (``persistent_q_sets``) its Q rows too.

    ``varlen = (cu_seqlens_q, cu_seqlens_k, B, search_steps)``: a packed batch (``launch.PreparedCall.varlen_args``),
    q ``[total_q, H, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, Dv]``, o ``[total_q, H, Dv]`` (contiguous),
    lse ``[H, total_q]``; not persistent.

    ``descale``: FP8 inputs (``attnzoo.attention_fp8``), q, k, v ``float8_e4m3fn`` with float32 factors ``[B, Hkv,
    3]``, v stored keys-contiguous (``v.stride(-2) == 1``), o bfloat16; dense, not persistent, D = 64 or 128.

    ``launch_key``: ``launch.PreparedCall.launch_key()`` of the call (``compiled_launch``; o and lse are the
    launcher's fresh outputs).
    """
    o_rows = o  # packed: the [total_q, H, Dv] tensor that the masked stores address
    if varlen is not None and persistent:
        raise ValueError("a packed batch runs one Q block per program: persistent=False")
    q, k, v, o, sequences = packed_views((q, k, v, o), {"o": o}, varlen, lse)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    check_warpgroup_rows(block_m, num_warps)

    Dv = v.shape[-1]
    d_first, d_second = head_dim_parts(D)  # ValueError for a head dim no tile pair holds
    if Dv & (Dv - 1) or Dv < 16:
        raise ValueError(f"Dv={Dv}: the Gluon forward's V and O tiles hold a power of two >= 16 columns")
    if d_second:
        # The column parts of q and k as views (same strides, the second one's base d_first columns on), each with
        # its own descriptor: the kernel's boxes start at column 0 of each.
        q_desc, q2_desc = tile_descriptor(q[..., :d_first], 64), tile_descriptor(q[..., d_first:], 64)
        k_desc, k2_desc = tile_descriptor(k[..., :d_first], block_n), tile_descriptor(k[..., d_first:], block_n)
    else:
        q_desc, k_desc = tile_descriptor(q, 64), tile_descriptor(k, block_n)
        q2_desc, k2_desc = q_desc, k_desc  # not read
    if persistent and block_m != 128:
        raise ValueError(f"persistent runs the warp-specialised 128-row blocks, got block_m={block_m}")
    num_m_blocks = grid_slots(Nq, block_m, varlen)
    num_tiles = num_m_blocks * B * H  # (packed: B = 1, the views' batch)
    if descale is None:
        v_desc = tile_descriptor(v, block_n)
    else:
        if persistent or varlen is not None or d_second:
            raise ValueError("FP8 inputs run dense, non-persistent calls with a power-of-two head dim")
        # The FP8 P V takes V K-major: boxes of the keys-contiguous [B, Hkv, Dv, Nk] view, Dv rows of BLOCK_N keys.
        v_desc = tile_descriptor(v.transpose(-1, -2), Dv, block_n)
    programs = min(num_tiles, sm_count(q.device)) if persistent else num_tiles
    q_sets = 1
    if persistent:
        q_sets = persistent_q_sets(D, Dv, block_n, num_stages, q.element_size(), shared_memory_limit(q.device))
    compiled_launch.launch(
        attention_forward_hopper_kernel, (programs,), launch_key,
        q_desc, k_desc, q2_desc, k2_desc, v_desc, tile_descriptor(o, 64), lse,
        H, H // Hkv, Nq, Nk, num_m_blocks, scale * LOG2E, *modifiers.args[1:], num_tiles,
        o_rows, o_rows.stride(0), Nq, *sequences, lse if descale is None else descale,
        BLOCK_N=block_n, BLOCK_D=d_first, BLOCK_D2=d_second, BLOCK_DV=Dv, CAUSAL=causal,
        NUM_WARPGROUPS=block_m // 64, NUM_STAGES=num_stages, IS_FP16=q.dtype == torch.float16,
        WINDOW_LEFT=modifiers.flags["WINDOW_LEFT"], WINDOW_RIGHT=modifiers.flags["WINDOW_RIGHT"],
        SOFTCAP=softcap_form(modifiers, q.dtype), ALIBI=modifiers.flags["ALIBI"], PERSISTENT=persistent,
        VARLEN=varlen is not None, DESCALE=descale is not None, Q_SETS=q_sets, num_warps=KERNEL_WARPS,
    )  # fmt: skip
