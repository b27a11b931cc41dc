"""The two-kernel backward above head dim 128 for Hopper, in Gluon: its dK/dV and dQ kernels with the head dim split
between two warpgroups, for D = Dv = 256 and for D = 192 with Dv = 128 (DeepSeek's MLA).

At D = 128 one warpgroup holds dK and dV of its 64 keys (64 registers a thread each, ``backward_gluon.py``), or dQ
of its 64 rows (``backward_gluon_dq.py``).  At D = 256 these accumulators would take 256 and 128 registers a thread
beside the score tiles (at D = 192, Dv = 128: 160 and 96), and the Triton tiles that served these head dims ran the
backward at 0.42-0.48x cuDNN's at D = 256 (about 165 TFLOP/s) and at 136-218 TFLOP/s at D = 192 (docs/design.md).
Here a block of 64 keys (dK/dV) or 64 rows (dQ) has two warpgroups, each holding some of the gradients' columns,
and the two 64 x 64 products that contract over the head dim (S over D, dP over Dv) are divided, not duplicated:
the *scores* warpgroup computes the scores and P, the *gradients* warpgroup dP and dS, and each hands its result to
the other through shared memory.  q and k (and dq, dk) arrive in two column parts, 128 and D - 128 (TMA boxes and
shared-memory tiles have power-of-two shapes); v, dO and dV in one tile of Dv.  The dK/dV kernel's Q tile ``t``,
with ``P = exp2(S * scale * log2(e) - lse2)`` and ``h = Dv / 2``:

    scores warpgroup                                  gradients warpgroup
    S^T_t = K Q_t^T (both parts)                      dP^T_t = V dO_t^T
    P^T_t -> shared memory ------ "p ready" ------>   P^T_t from shared memory
    dV[:, :h] += P^T_t dO_t[:, :h]                    dS^T_t = P^T_t (dP^T_t - Delta_t) -> shared memory
                           <----- "ds ready" ------   dV[:, h:] += P^T_t dO_t[:, h:]   (P^T from shared memory)
    dK[:, 128:] += dS^T_t Q_t[:, 128:]                dK[:, :128] += dS^T_t Q_t[:, :128]   (dS^T from registers)

The scores warpgroup takes dK's second part because its S product contracts over all of D where dP contracts over
Dv: at D = 192, Dv = 128 each warpgroup then issues 320 of the 640 (64 x 64 x 64-column) product steps of a tile
(S 192 + dK 64 + dV 64 against dP 128 + dK 128 + dV 64), and at D = 256 each issues half as well.  The dQ
kernel's K/V tile ``j`` is the same exchange with rows and keys swapped: ``S_j = Q K_j^T`` and ``P_j`` in the
scores warpgroup, ``dP_j = dO V_j^T`` and ``dS_j`` in the other, and each adds ``dS_j K_j[:, cols]`` into its
columns of dQ (the scores warpgroup the second part's).  So each warpgroup runs half of a tile's products and half
of its arithmetic, and one's exponentials run while the other's ``dP`` product does.  The P and dS slots are each
rewritten once the other warpgroup has released them ("p free", "ds free").  dS is taken from P rounded to the input
dtype (as the products take it), so the bits differ from the Triton kernels'.  A producer warp
(``gl.warp_specialize``) loads the resident tiles (K and V, or Q and dO) once and streams the others through a ring
of NUM_STAGES slots, which both warpgroups release.  Shared memory at D = 256: 64 KB resident, two 64 KB slots,
16 KB for the exchange (24 KB in the soft-capped dK/dV kernel: below), one CTA per SM (140 KB at D = 192, Dv = 128,
where a third ring slot measured 0.96-1.02x).
After the loop the gradients go through the shared memory of a resident tile that no product reads any more (each
warpgroup its columns) and one TMA store per part (masked stores for a block that a packed sequence's end cuts).

Measured on the H100 (``bench/results/h100_d256_wide_*.csv``, ``h100_d192_wide_bwd.csv``): at D = 256 (bf16/fp16,
N = 2k-16k, causal or not) the backward at 314-387 TFLOP/s, 0.99-1.07x cuDNN's, the tuner taking these kernels at
every D = 256 key (the Triton tiles took 1.63-1.98x (dQ) and 2.56-3.14x (dK/dV) their time); at D = 192, Dv = 128
247-313 TFLOP/s, 1.40-1.82x the Triton tiles, 1.09-1.11x cuDNN without a mask and 0.66-0.73x with the causal one.

Sliding windows take the D <= 128 kernels' loop bounds (``q_loop_bounds``, ``q_block_tiles``): tiles outside the
band are never loaded, and the scores warpgroup masks P in those an edge cuts.  With a 1024-key causal window the
backward ran 2.04-2.30x the Triton tiles' (``bench/results/h100_wide_bwd_window.csv``).

The soft cap and ALiBi are terms of the scores, applied by the scores warpgroup with the D <= 128 kernels' helpers.
The cap's derivative ``1 - tanh^2`` belongs to dS, which the other warpgroup forms: the scores warpgroup hands over
``P (1 - tanh^2)`` (in the dQ kernel in P's slot, which the gradients warpgroup reads only for dS; in the dK/dV kernel
in a third exchange slot, released with P's, since that warpgroup's half of dV needs P itself).  At Gemma-2's shape
(D = 256, soft cap 50, bf16, causal) the backward ran 2.04-2.13x the Triton tiles of the untimed pick and 3.2x
FlexAttention's, with ALiBi 2.26-2.40x and 2.9-3.0x (``bench/results/h100_d256_modifiers_ab.csv``).

Packed batches (VARLEN) take the D <= 128 kernels' way: programs map to (sequence, block) slots
(``common.kv_block_opening``, ``q_block_tiles``), a sequence's last ring tile (Q and dO in the dK/dV kernel, K and
V in the dQ kernel) lands on a tail barrier and the producer warp zeroes its rows past the end before handing the
slot over (the next sequence's values meet P = 0 there, and ``0 * NaN`` is NaN), and a block that the sequence's
end cuts leaves by masked stores.  The producer warp, at 24 registers, zeroes 128 columns at a time
(``zero_rows_from``; a chunk of 256 columns spilled 1.6-1.8 KB at D = 256): the packed builds spill 16-60 B in
ptxas, 140-168 B in the D = 256 dQ kernel (``bench/results/ptx_wide_modifiers_triton39.log``).

Scope (``KernelVariant.DKDV`` and ``KernelVariant.DQ`` ``gluon_scope``): ``WIDE_HEAD_DIMS``, dense or packed
calls, causal or not, windows, the soft cap, ALiBi, GQA.  The
five-product backward has no block above D = 128: ``triton_atomic`` runs its Triton kernel there (and,
deterministic, this backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import compiled_launch
from .common import LOG2E, load_lse2, q_loop_bounds
from .forward_gluon import KERNEL_WARPS
from .gluon_hopper import (
    accumulator_layout,
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    grid_slots,
    mbarrier,
    packed_views,
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
from .tuning import WIDE_GLUON_TILE

if TYPE_CHECKING:
    from .launch import ScoreModifiers

if gluon is not None:
    # The other Gluon kernels' helpers (defined only where Gluon is).
    from .backward_gluon import _load_row_stat, _mask_cut_tile_t, _modified_scores_t, _tile_of, kv_block_of
    from .backward_gluon_dq import _alibi_split, _row_stats, _tile_p, dq_row_pointers
    from .forward_gluon import alibi_key_term, q_block_tiles

    @gluon.jit
    def _load_three(descs, bar, tiles, batch, head, row):
        """TMA copies of the boxes at ``[batch, head, row, 0]`` of three descriptors (the head dim's two column parts
        and v's or dO's columns) into ``tiles``, all completing ``bar``."""
        NBYTES: gl.constexpr = descs[0].block_type.nbytes + descs[1].block_type.nbytes + descs[2].block_type.nbytes
        mbarrier.expect(bar, NBYTES)
        tma_load(descs[0], [batch, head, row, 0], bar, tiles[0])
        tma_load(descs[1], [batch, head, row, 0], bar, tiles[1])
        tma_load(descs[2], [batch, head, row, 0], bar, tiles[2])

    @gluon.jit
    def _wide_buffers(
        resident_descs, ring_descs, NUM_STAGES: gl.constexpr, DTYPE: gl.constexpr, SCALED_P: gl.constexpr
    ):  # fmt: skip
        """Both kernels' shared memory: three resident tiles (K's two column parts and V, or Q's and dO) with the
        mbarrier their loads complete; three rings of NUM_STAGES tiles (Q's parts and dO, or K's and V) with each
        slot's "ready" mbarrier and its "empty" one, which an arrive of each warpgroup completes; and what the
        warpgroups exchange a tile through, a P slot and a dS slot ``[rows of the resident tiles, rows of the
        ring's]`` (SCALED_P: a third, for P times the soft cap's derivative) with six mbarriers: p_ready, p_free,
        ds_ready, ds_free (one arrive completes them), loop_done, halves_stored (one from each warpgroup).
        -> ``(smem, resident_bar, ring_ready, ring_empty, exchange_bars, exchange)``: ``smem = (resident part 1,
        part 2, resident values, ring part 1, part 2, ring values, p_smem, ds_smem, scaled_p_smem)`` (without
        SCALED_P the last is p_smem again), ``exchange`` the six mbarriers (``_invalidate_wide`` takes the
        arrays)."""
        ROWS: gl.constexpr = resident_descs[0].block_type.shape[2]
        COLS: gl.constexpr = ring_descs[0].block_type.shape[2]
        resident = gl.allocate_shared_memory(DTYPE, resident_descs[0].block_type.shape, resident_descs[0].layout)
        resident2 = gl.allocate_shared_memory(DTYPE, resident_descs[1].block_type.shape, resident_descs[1].layout)
        resident_v = gl.allocate_shared_memory(DTYPE, resident_descs[2].block_type.shape, resident_descs[2].layout)
        ring = gl.allocate_shared_memory(
            DTYPE, [NUM_STAGES, 1, 1, COLS, ring_descs[0].block_type.shape[3]], ring_descs[0].layout
        )  # fmt: skip
        ring2 = gl.allocate_shared_memory(
            DTYPE, [NUM_STAGES, 1, 1, COLS, ring_descs[1].block_type.shape[3]], ring_descs[1].layout
        )  # fmt: skip
        ring_v = gl.allocate_shared_memory(
            DTYPE, [NUM_STAGES, 1, 1, COLS, ring_descs[2].block_type.shape[3]], ring_descs[2].layout
        )  # fmt: skip
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], DTYPE)
        p_smem = gl.allocate_shared_memory(DTYPE, [ROWS, COLS], layout)
        ds_smem = gl.allocate_shared_memory(DTYPE, [ROWS, COLS], layout)
        if SCALED_P:
            scaled_p_smem = gl.allocate_shared_memory(DTYPE, [ROWS, COLS], layout)
        else:
            scaled_p_smem = p_smem  # not used
        resident_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ring_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        ring_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        exchange_bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        mbarrier.init(resident_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ring_ready.index(i), count=1)
            mbarrier.init(ring_empty.index(i), count=2)
        for i in gl.static_range(6):
            mbarrier.init(exchange_bars.index(i), count=1 if i < 4 else 2)
        fence_async_shared()
        exchange = (
            exchange_bars.index(0), exchange_bars.index(1), exchange_bars.index(2), exchange_bars.index(3),
            exchange_bars.index(4), exchange_bars.index(5),
        )  # fmt: skip
        smem = (resident, resident2, resident_v, ring, ring2, ring_v, p_smem, ds_smem, scaled_p_smem)
        return smem, resident_bar, ring_ready, ring_empty, exchange_bars, exchange

    @gluon.jit
    def _invalidate_wide(resident_bar, ring_ready, ring_empty, exchange_bars, NUM_STAGES: gl.constexpr):
        mbarrier.invalidate(resident_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ring_ready.index(i))
            mbarrier.invalidate(ring_empty.index(i))
        for i in gl.static_range(6):
            mbarrier.invalidate(exchange_bars.index(i))

    @gluon.jit
    def _dkdv_half(
        smem, bars, scalars, modifiers, stats, stats_at, PART: gl.constexpr, BLOCK_M: gl.constexpr,
        KEYS: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr,
        CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
    ):  # fmt: skip
        """The loop of one warpgroup (the module docstring's table): PART 0 the scores warpgroup, PART 1 the
        gradients warpgroup; each accumulates its columns of dK (PART 0 the second part's BLOCK_D2, PART 1 the
        first part's BLOCK_D) and its half of dV's BLOCK_DV for the block's KEYS keys, then stores them into K's
        and V's shared memory tiles (TMA-stored by the scores warpgroup).

        ``smem = (k_smem, k2_smem, v_smem, q_ring, q2_ring, do_ring, pt_smem, ds_smem, scaled_pt_smem)``; ``bars =
        (q_do_bars, q_do_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored)``; ``scalars = (lo,
        unmasked_lo, unmasked_hi, n_iters, tiles_per_head, start_n, diagonal_offset, slopes_row, first_head,
        sm_scale, qk_scale)``: rows and keys count within the sequence (a packed batch's); Q tiles below
        ``unmasked_lo`` or from ``unmasked_hi`` on take the mask (``q_loop_bounds``); ``modifiers = (window_left,
        window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h)`` as the D <= 128 kernel takes
        them (the soft cap and ALiBi apply in the scores warpgroup, which with SOFTCAP also hands over ``P^T (1 -
        tanh^2)`` for the other's dS^T); ``stats = (lse2_ptr, delta_ptr)``."""
        k_smem, k2_smem, v_smem, q_ring, q2_ring, do_ring, pt_smem, ds_smem, scaled_pt_smem = smem
        q_do_bars, q_do_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored = bars
        (lo, unmasked_lo, unmasked_hi, n_iters, tiles_per_head, start_n, diagonal_offset, slopes_row, first_head,
         sm_scale, qk_scale) = scalars  # fmt: skip
        window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h = modifiers
        lse2_ptr, delta_ptr = stats
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        DK_COLS: gl.constexpr = BLOCK_D2 if PART == 0 else BLOCK_D
        DV_COLS: gl.constexpr = BLOCK_DV // 2
        st_layout: gl.constexpr = accumulator_layout(4, BLOCK_M)
        dk_layout: gl.constexpr = accumulator_layout(4, DK_COLS)
        dv_layout: gl.constexpr = accumulator_layout(4, DV_COLS)
        # The register operands: PART 0's P^T of dV's product, PART 1's dS^T of dK's.
        p_operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        ds_operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
        row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        k_tile = k_smem.reshape([KEYS, BLOCK_D])
        k2_tile = k2_smem.reshape([KEYS, BLOCK_D2])
        v_tile = v_smem.reshape([KEYS, BLOCK_DV])
        keys = start_n + gl.arange(0, KEYS, key_layout)
        local_rows = gl.arange(0, BLOCK_M, row_layout)
        dk = gl.zeros([KEYS, DK_COLS], gl.float32, dk_layout)
        dv = gl.zeros([KEYS, DV_COLS], gl.float32, dv_layout)
        scores = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)  # S^T or dP^T (ignored accumulator input)

        for t in range(n_iters):
            g, start_m = _tile_of(t, lo, tiles_per_head, BLOCK_M, False)
            rows = start_m + local_rows
            use = t & 1  # the exchange barriers complete once per tile
            # This warpgroup's statistic of the tile's rows, loaded before the waits so that they hide its latency.
            if PART == 0:
                lse2 = _load_row_stat(lse2_ptr, t, stats_at, float("inf"), row_layout, BLOCK_M, False)
            else:
                delta = _load_row_stat(delta_ptr, t, stats_at, 0.0, row_layout, BLOCK_M, False)
            q_tile = ring_wait(q_do_bars, q_ring, t, BLOCK_M, BLOCK_D, NUM_STAGES)
            q2_tile = q2_ring.index(t % NUM_STAGES).reshape([BLOCK_M, BLOCK_D2])  # (the same barrier)
            do_tile = do_ring.index(t % NUM_STAGES).reshape([BLOCK_M, BLOCK_DV])
            do_half = do_tile.slice(PART * DV_COLS, DV_COLS, dim=1)
            if PART == 0:
                # S^T = K Q^T over both column parts, the second product accumulating onto the first.
                scores = warpgroup_mma(k_tile, q_tile.permute((1, 0)), scores, use_acc=False, is_async=True)
                scores = warpgroup_mma(k2_tile, q2_tile.permute((1, 0)), scores, is_async=True)
                scores = warpgroup_mma_wait(0, deps=(scores,))
                s2, lse2, tanh = _modified_scores_t(
                    scores, lse2, qk_scale, keys, rows, start_n, diagonal_offset, cap_in, cap_out,
                    (alibi_ptr, slopes_row, first_head + g, stride_alibi_b, stride_alibi_h), CAUSAL, SOFTCAP, ALIBI,
                )  # fmt: skip
                p_t = gl.exp2(s2 - lse2[None, :])
                if CAUSAL or WINDOW_LEFT or WINDOW_RIGHT:
                    p_t = _mask_cut_tile_t(
                        p_t, start_m, unmasked_lo, unmasked_hi, keys, rows, diagonal_offset, window_left,
                        window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                    )  # fmt: skip
                p_16 = p_t.to(DTYPE)
                # The gradients warpgroup has read the previous P^T (its dS^T and its dV product are done).
                mbarrier.wait(p_free, use ^ 1)
                pt_smem.store(p_16)
                if SOFTCAP:  # dS^T = P^T (dP^T - Delta) (1 - tanh^2): the other warpgroup takes the first and last
                    # factors as one tile (rounded as P^T is), its registers holding no more than without the cap
                    scaled_pt_smem.store((p_t * (1.0 - tanh * tanh)).to(DTYPE))
                fence_async_shared()
                cta_barrier()  # every warp's rows are in before the one arrive
                mbarrier.arrive(p_ready)
                p_op = gl.convert_layout(p_16, p_operand_layout)
                dv = warpgroup_mma(p_op, do_half, dv, is_async=True)
                mbarrier.wait(ds_ready, use)
                dk = warpgroup_mma(ds_smem, q2_tile, dk, is_async=True)
                dv, dk, p_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op))
                mbarrier.arrive(ds_free)  # this tile's dS^T is read: the slot may be rewritten
            else:
                scores = warpgroup_mma(v_tile, do_tile.permute((1, 0)), scores, use_acc=False, is_async=True)
                mbarrier.wait(p_ready, use)
                if SOFTCAP:
                    p_t = scaled_pt_smem.load(st_layout).to(gl.float32)
                else:
                    p_t = pt_smem.load(st_layout).to(gl.float32)
                scores = warpgroup_mma_wait(0, deps=(scores,))
                ds_16 = (p_t * (scores - delta[None, :])).to(DTYPE)
                mbarrier.wait(ds_free, use ^ 1)  # the scores warpgroup's dK product has read the previous dS^T
                ds_smem.store(ds_16)
                fence_async_shared()
                cta_barrier()
                mbarrier.arrive(ds_ready)
                dv = warpgroup_mma(pt_smem, do_half, dv, is_async=True)
                ds_op = gl.convert_layout(ds_16, ds_operand_layout)
                dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
                dv, dk, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, ds_op))
                mbarrier.arrive(p_free)
            # A wgmma is one operation of the whole warpgroup: once complete here, it has read its shared memory for
            # all four warps, so one arrive per warpgroup releases the Q/dO slot.
            mbarrier.arrive(q_do_empty.index(t % NUM_STAGES))

        # K is read by the scores warpgroup's products and V by the other's: neither tile is overwritten before both
        # loops are done.  Each warpgroup then writes its columns of dK and dV; keys that no row sees store zeros.
        mbarrier.arrive(loop_done)
        mbarrier.wait(loop_done, 0)
        if PART == 0:
            k2_tile.store((dk * sm_scale).to(DTYPE))
        else:
            k_tile.store((dk * sm_scale).to(DTYPE))
        v_tile.slice(PART * DV_COLS, DV_COLS, dim=1).store(dv.to(DTYPE))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(halves_stored)

    @gluon.jit
    def _zero_tail_rows(tiles, first_zero):
        """Zero the rows ``first_zero ..`` of the three ``[1, 1, ROWS, width]`` tiles of a ring slot (the producer
        warp's ``zero_rows_from``): a packed sequence's last tile, whose later rows are the next sequence's.  P is 0
        there, but ``0 * NaN`` is not."""
        first, second, values = tiles
        zero_rows_from(first.reshape([first.type.shape[2], first.type.shape[3]]), first_zero, 1)
        zero_rows_from(second.reshape([second.type.shape[2], second.type.shape[3]]), first_zero, 1)
        zero_rows_from(values.reshape([values.type.shape[2], values.type.shape[3]]), first_zero, 1)

    @gluon.jit
    def _dkdv_wide_load_tiles(
        q_descs, kv_descs, smem, kv_bar, q_do_bars, q_do_empty, q_tail, batch, kv_head, key_row, first_head,
        q_origin, lo, tiles_per_head, n_iters, seq_q, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
        VARLEN: gl.constexpr,
    ):  # fmt: skip
        """The producer warp: K (both parts) and V of the block (TMA row ``key_row``), then Q (both parts) and dO of
        tile ``i`` (rows from ``q_origin``) into slot ``i % NUM_STAGES`` once both warpgroups have released the
        slot's previous tiles.  VARLEN: a tile that reaches past the sequence's last row lands on ``q_tail``; this warp
        zeroes its rows past the sequence, then completes the slot's barrier.  Every query head of the group runs the
        same Q tiles, so either each head's last tile is such a tile or none is: the g-th use of ``q_tail``."""
        _load_three(kv_descs, kv_bar, (smem[0], smem[1], smem[2]), batch, kv_head, key_row)
        for i in range(n_iters):
            slot = i % NUM_STAGES
            # An mbarrier starts as if its phase "-1" had completed, so the waits of the first round pass at once.
            mbarrier.wait(q_do_empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
            g, start_m = _tile_of(i, lo, tiles_per_head, BLOCK_M, False)
            tiles = (smem[3].index(slot), smem[4].index(slot), smem[5].index(slot))
            if VARLEN and start_m + BLOCK_M > seq_q:
                tail = q_tail.index(0)
                _load_three(q_descs, tail, tiles, batch, first_head + g, q_origin + start_m)
                mbarrier.wait(tail, g & 1)  # the g-th use of q_tail: one per query head, its last tile
                _zero_tail_rows(tiles, seq_q - start_m)
                mbarrier.arrive(q_do_bars.index(slot))
            else:
                _load_three(q_descs, q_do_bars.index(slot), tiles, batch, first_head + g, q_origin + start_m)

    @gluon.jit
    def _dkdv_wide_scores(
        smem, bars, kv_bar, scalars, modifiers, stats, stats_at, outputs, batch, kv_head, k_origin, seq_k,
        BLOCK_M: gl.constexpr, KEYS: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
        BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        VARLEN: gl.constexpr,
    ):  # fmt: skip
        """The default partition: the scores warpgroup's loop, then, once both warpgroups have written their columns,
        the stores of dK's parts and dV: TMA stores (``outputs = (dk_desc, dk2_desc, dv_desc, dk_ptr, dv_ptr,
        stride_dk_row, stride_dv_row)``), or, for a block that the end of a packed sequence cuts, masked stores of
        its rows (a TMA box would write the next sequence's)."""
        mbarrier.wait(kv_bar, 0)
        _dkdv_half(smem, bars, scalars, modifiers, stats, stats_at, 0, BLOCK_M, KEYS, BLOCK_D, BLOCK_D2, BLOCK_DV,
                   CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16)  # fmt: skip
        mbarrier.wait(bars[7], 0)  # halves_stored: both warpgroups' columns are in
        start_n = scalars[5]
        dk_desc, dk2_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row = outputs
        if VARLEN:  # (compile-time, as the forward's O store: no masked stores in dense builds)
            if start_n + KEYS > seq_k:
                row = (k_origin + start_n).to(gl.int64)
                kept = seq_k - start_n
                dk_row = dk_ptr + row * stride_dk_row + kv_head * (BLOCK_D + BLOCK_D2)
                store_rows_below(smem[0].reshape([KEYS, BLOCK_D]), dk_row, stride_dk_row, kept, 4)
                store_rows_below(smem[1].reshape([KEYS, BLOCK_D2]), dk_row + BLOCK_D, stride_dk_row, kept, 4)
                dv_row = dv_ptr + row * stride_dv_row + kv_head * BLOCK_DV
                store_rows_below(smem[2].reshape([KEYS, BLOCK_DV]), dv_row, stride_dv_row, kept, 4)
            else:
                tma_store(dk_desc, [batch, kv_head, k_origin + start_n, 0], smem[0])
                tma_store(dk2_desc, [batch, kv_head, k_origin + start_n, 0], smem[1])
                tma_store(dv_desc, [batch, kv_head, k_origin + start_n, 0], smem[2])
        else:
            tma_store(dk_desc, [batch, kv_head, start_n, 0], smem[0])
            tma_store(dk2_desc, [batch, kv_head, start_n, 0], smem[1])
            tma_store(dv_desc, [batch, kv_head, start_n, 0], smem[2])
        tma.store_wait(0)

    @gluon.jit
    def _dkdv_wide_gradients(
        smem, bars, kv_bar, scalars, modifiers, stats, stats_at, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
        BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr,
        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
        NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
    ):  # fmt: skip
        """The second warpgroup: the gradients warpgroup's loop."""
        mbarrier.wait(kv_bar, 0)
        _dkdv_half(smem, bars, scalars, modifiers, stats, stats_at, 1, BLOCK_M, KEYS, BLOCK_D, BLOCK_D2, BLOCK_DV,
                   CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16)  # fmt: skip

    @gluon.jit(do_not_specialize=[
        "num_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "num_n_blocks", "window_left",
        "window_right", "stride_alibi_b", "stride_alibi_h", "num_sequences", "search_steps",
    ])  # fmt: skip
    def attention_dkdv_wide_kernel(
        q_desc,
        q2_desc,
        k_desc,
        k2_desc,
        v_desc,
        do_desc,
        dk_desc,
        dk2_desc,
        dv_desc,
        lse2_ptr,
        delta_ptr,
        num_heads,
        num_kv_heads,
        group_size,
        seqlen_q,
        seqlen_k,
        num_n_blocks,
        sm_scale,
        qk_scale,
        window_left,
        window_right,
        cap_in,
        cap_out,
        alibi_ptr,
        stride_alibi_b,
        stride_alibi_h,
        dk_ptr,
        dv_ptr,
        stride_dk_row,
        stride_dv_row,
        cu_seqlens_q,
        cu_seqlens_k,
        num_sequences,
        search_steps,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_D: gl.constexpr,
        BLOCK_D2: gl.constexpr,
        BLOCK_DV: gl.constexpr,
        CAUSAL: gl.constexpr,
        WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr,
        SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        IS_FP16: gl.constexpr,
        VARLEN: gl.constexpr,
    ):
        """dK, dV of one block of BLOCK_N = 64 keys of one (batch, kv head), summed over the ``group_size`` query
        heads that read the kv head; grid: 1-d, ``num_n_blocks * B * Hkv`` programs, launched with 4 warps (the
        scores warpgroup) and given the gradients warpgroup and the producer warp by ``gl.warp_specialize``.  The
        head dim arrives in two column parts (``q_desc``/``k_desc``/``dk_desc`` BLOCK_D = 128 columns,
        ``q2_desc``/``k2_desc``/``dk2_desc`` the next BLOCK_D2), v, do and dv in one of BLOCK_DV.  WINDOW_LEFT /
        WINDOW_RIGHT: the sliding window's bounds ``window_left`` / ``window_right`` (``ScoreModifiers``).  SOFTCAP:
        scores become ``c tanh(s / c)`` (``cap_in``, ``cap_out`` as ``ScoreModifiers`` gives them; the hardware's
        ``tanh.approx.f32``).  ALIBI: ``-slope |i' - j|`` with the slopes float32 ``[B, H]`` at ``alibi_ptr`` (strides
        given), split as the D <= 128 kernel splits it under a causal mask.

        VARLEN (a packed batch): the descriptors are over ``[1, H, total, D]`` views of the packed tensors, the grid
        has ``num_n_blocks = total_k // BLOCK_N + B`` slots per K/V head (``common.kv_block_opening``; idle slots
        return at once), lse2 and Delta are ``[H, total_q]``, and ``dk_ptr``/``dv_ptr`` with their row strides
        address the packed dK and dV for the rows a TMA store may not write."""
        gl.static_assert(BLOCK_N == 64 and BLOCK_M == 64, "64 keys a block (one warpgroup's M), 64-row Q tiles")
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        batch, kv_head, start_n, q_origin, k_origin, seq_q, seq_k, slopes_row = kv_block_of(
            gl.program_id(0), num_n_blocks, num_kv_heads, seqlen_q, seqlen_k,
            (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps), BLOCK_N, VARLEN,
        )  # fmt: skip
        if VARLEN:  # noqa: SIM102 - a compile-time branch around a runtime one
            if start_n >= seq_k:  # an idle slot of the packed grid
                return
        first_head = kv_head * group_size
        # The same Q-tile ranges as the D <= 128 kernel (backward_gluon): [lo, unmasked_lo) and [unmasked_hi, hi) take
        # the mask; rows outside [lo, hi) see none of the block's keys and are never loaded.
        lo, unmasked_lo, unmasked_hi, hi = q_loop_bounds(
            start_n, seq_q, seq_k, start_n + BLOCK_N, window_left, window_right, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        tiles_per_head = (hi - lo) // BLOCK_M
        n_iters = tiles_per_head * group_size

        # P^T and dS^T are exchanged, keys along the rows.
        kv_descs = (k_desc, k2_desc, v_desc)
        q_descs = (q_desc, q2_desc, do_desc)
        smem, kv_bar, q_do_bars, q_do_empty, exchange_bars, exchange = _wide_buffers(
            kv_descs, q_descs, NUM_STAGES, DTYPE, SOFTCAP
        )  # fmt: skip
        p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored = exchange
        if VARLEN:  # the sequences' last Q tiles, which the producer warp zeroes past the end before handing over
            q_tail = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_tail.index(0), count=1)
            fence_async_shared()
        else:
            q_tail = q_do_bars  # not used
        bars = (q_do_bars, q_do_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored)
        scalars = (lo, unmasked_lo, unmasked_hi, n_iters, tiles_per_head, start_n, seq_k - seq_q, slopes_row,
                   first_head, sm_scale, qk_scale)  # fmt: skip
        modifiers = (window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h)
        stats = (lse2_ptr, delta_ptr)
        # Statistics: dense [B, H, Nq], or packed [H, total_q] (seqlen_q is total_q) from the sequence's first row.
        stats_at = (n_iters, lo, tiles_per_head, batch * num_heads + first_head, seqlen_q, q_origin, seq_q)
        outputs = (dk_desc, dk2_desc, dv_desc, dk_ptr, dv_ptr, stride_dk_row, stride_dv_row)
        # Constexpr arguments go to the partitions as literals (forward_gluon's note).  The gradients warpgroup and
        # (by what is left) the scores warpgroup get 240 registers, the producer warp 24.
        gl.warp_specialize(
            [
                (_dkdv_wide_scores, (smem, bars, kv_bar, scalars, modifiers, stats, stats_at, outputs, batch,
                                     kv_head, k_origin, seq_k, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL,
                                     WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16, VARLEN)),
                (_dkdv_wide_gradients, (smem, bars, kv_bar, scalars, modifiers, stats, stats_at, BLOCK_M, BLOCK_N,
                                        BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                                        ALIBI, NUM_STAGES, IS_FP16)),
                (_dkdv_wide_load_tiles, (q_descs, kv_descs, smem, kv_bar, q_do_bars, q_do_empty, q_tail, batch,
                                         kv_head, k_origin + start_n, first_head, q_origin, lo, tiles_per_head,
                                         n_iters, seq_q, BLOCK_M, NUM_STAGES, VARLEN)),
            ],
            [4, 1],
            [240, 24],
        )  # fmt: skip

        _invalidate_wide(kv_bar, q_do_bars, q_do_empty, exchange_bars, NUM_STAGES)
        if VARLEN:
            mbarrier.invalidate(q_tail.index(0))

    @gluon.jit
    def _dq_half(
        smem, bars, scalars, modifiers, pointers, PART: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
        BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NUM_STAGES: gl.constexpr,
        IS_FP16: gl.constexpr,
    ):  # fmt: skip
        """The dQ kernel's loop of one warpgroup over the K/V tiles of a 64-row Q block, the dK/dV kernel's
        exchange with the roles of rows and keys swapped: PART 0 computes ``S_j = Q K_j^T`` and ``P_j`` and hands
        P_j over, PART 1 computes ``dP_j = dO V_j^T`` and ``dS_j`` and hands dS_j over, and each adds ``dS_j
        K_j[:, cols]`` into its columns of dQ (PART 0 the second part's, PART 1 the first's); then stores them,
        scaled, into Q's shared memory tiles (TMA-stored by PART 0).  PART 1 also writes Delta and lse2 for the
        dK/dV kernel (``_row_stats``).

        ``smem = (q_smem, q2_smem, do_smem, k_ring, k2_ring, v_ring, p_smem, ds_smem, _)``; ``bars = (q_bar,
        kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored)``; ``scalars = (start_m,
        seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles, sm_scale, qk_scale, row_origin)``: rows
        and keys count within the sequence (a packed batch's, whose first row is row ``row_origin`` of o and do);
        the K/V tiles below ``left_tiles`` (the window's left edge) or from ``unmasked_tiles`` on take the mask
        (``q_block_tiles``); ``modifiers = (window_left, window_right, cap_in, cap_out, slope2)`` as ``_tile_p``
        takes them (the soft cap and ALiBi apply in PART 0, which with SOFTCAP hands over ``P (1 - tanh^2)``, all
        that PART 1 reads of P); ``pointers`` as ``_row_stats`` takes them, and lse."""
        q_smem, q2_smem, do_smem, k_ring, k2_ring, v_ring, p_smem, ds_smem, _ = smem
        q_bar, kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored = bars
        start_m, seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles, sm_scale, qk_scale, row_origin = (
            scalars
        )  # fmt: skip
        o_rows, stride_o_row, do_rows, stride_do_row, lse_ptr, lse2_ptr, delta_ptr, stats = pointers
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        ROWS: gl.constexpr = q_smem.type.shape[2]
        DQ_COLS: gl.constexpr = BLOCK_D2 if PART == 0 else BLOCK_D
        s_layout: gl.constexpr = accumulator_layout(4, BLOCK_N)
        dq_layout: gl.constexpr = accumulator_layout(4, DQ_COLS)
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows = start_m + gl.arange(0, ROWS, row_layout)
        local_keys = gl.arange(0, BLOCK_N, key_layout)
        diagonal_offset = seqlen_k - seqlen_q
        slope2 = modifiers[4]
        if PART == 0:
            # lse in base 2 (+inf on an empty row: P = 0), as _row_stats stores it, and what P is taken from
            # (with causal ALiBi, the rows' term added: _alibi_split)
            lse2 = load_lse2(lse_ptr + stats + rows, rows, seqlen_q, True)
            lse2_p, alibi_origin, alibi_local = _alibi_split(
                lse2, rows, start_m, diagonal_offset, local_keys, slope2, CAUSAL, ALIBI
            )  # fmt: skip
        else:
            delta, _ = _row_stats(
                o_rows, stride_o_row, do_rows, stride_do_row, lse_ptr, lse2_ptr, delta_ptr, stats,
                row_origin + start_m, start_m, seqlen_q, ROWS, BLOCK_DV, 4,
            )  # fmt: skip
            delta = gl.convert_layout(delta, row_layout)
        mbarrier.wait(q_bar, 0)
        q_tile = q_smem.reshape([ROWS, BLOCK_D])
        q2_tile = q2_smem.reshape([ROWS, BLOCK_D2])
        do_tile = do_smem.reshape([ROWS, BLOCK_DV])
        dq = gl.zeros([ROWS, DQ_COLS], gl.float32, dq_layout)
        scores = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)  # S or dP (ignored accumulator input)

        for j in range(n_tiles):
            use = j & 1
            k_tile = ring_wait(kv_ready, k_ring, j, BLOCK_N, BLOCK_D, NUM_STAGES)
            k2_tile = k2_ring.index(j % NUM_STAGES).reshape([BLOCK_N, BLOCK_D2])  # (the same barrier)
            v_tile = v_ring.index(j % NUM_STAGES).reshape([BLOCK_N, BLOCK_DV])
            if PART == 0:
                scores = warpgroup_mma(q_tile, k_tile.permute((1, 0)), scores, use_acc=False, is_async=True)
                scores = warpgroup_mma(q2_tile, k2_tile.permute((1, 0)), scores, is_async=True)
                scores = warpgroup_mma_wait(0, deps=(scores,))
                # Tiles from unmasked_tiles on are cut by the diagonal (or the window's right edge) or by Nk, and those
                # below left_tiles by the window's left edge (q_block_tiles).
                p, dcap = _tile_p(
                    scores, lse2_p, rows, first_key + j * BLOCK_N + local_keys, diagonal_offset, seqlen_k, qk_scale,
                    modifiers,
                    alibi_key_term(alibi_local, first_key + j * BLOCK_N, alibi_origin, slope2, CAUSAL, ALIBI),
                    (j < left_tiles) | (j >= unmasked_tiles), CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
                )  # fmt: skip
                if SOFTCAP:  # dS = P (dP - Delta) (1 - tanh^2): PART 1 takes P only for dS, so the slot holds the
                    # first and last factors as one tile (rounded as P is)
                    p = p * dcap
                p_16 = p.to(DTYPE)
                mbarrier.wait(p_free, use ^ 1)  # the other warpgroup has read the previous P
                p_smem.store(p_16)
                fence_async_shared()
                cta_barrier()
                mbarrier.arrive(p_ready)
                mbarrier.wait(ds_ready, use)
                dq = warpgroup_mma(ds_smem, k2_tile, dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq,))
                mbarrier.arrive(ds_free)
            else:
                scores = warpgroup_mma(do_tile, v_tile.permute((1, 0)), scores, use_acc=False, is_async=True)
                mbarrier.wait(p_ready, use)
                p = p_smem.load(s_layout).to(gl.float32)
                scores = warpgroup_mma_wait(0, deps=(scores,))
                ds_16 = (p * (scores - delta[:, None])).to(DTYPE)
                mbarrier.wait(ds_free, use ^ 1)  # the other warpgroup's product has read the previous dS
                ds_smem.store(ds_16)
                fence_async_shared()
                # Every warp has read P (its loads come before its dS stores): one arrive frees the P slot, and one
                # hands dS over.  (An arrive is one thread's, so not before this barrier.)
                cta_barrier()
                mbarrier.arrive(p_free)
                mbarrier.arrive(ds_ready)
                ds_op = gl.convert_layout(ds_16, operand_layout)
                dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
                dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
            mbarrier.arrive(kv_empty.index(j % NUM_STAGES))  # (one arrive per warpgroup: see _dkdv_half)

        # Q is read by PART 0's products only; once both loops are done each warpgroup writes its dQ columns there.
        mbarrier.arrive(loop_done)
        mbarrier.wait(loop_done, 0)
        if PART == 0:
            q2_tile.store((dq * sm_scale).to(DTYPE))
        else:
            q_tile.store((dq * sm_scale).to(DTYPE))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(halves_stored)

    @gluon.jit
    def _dq_wide_load_tiles(
        q_descs, kv_descs, smem, q_bar, kv_ready, kv_empty, kv_tail, batch, head, kv_head, q_row, first_key, n_tiles,
        key_end, NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """The dQ kernel's producer warp: Q (both parts) and dO of the block (TMA row ``q_row``), then K (both parts)
        and V of tile ``j`` (keys from TMA row ``first_key``) into slot ``j % NUM_STAGES`` once both warpgroups have
        released the slot's previous tiles.  VARLEN: a tile that reaches past the sequence's last key (``key_end``,
        at most the last tile) lands on ``kv_tail``; this warp zeroes its rows past the sequence, then completes the
        slot's barrier."""
        BLOCK_N: gl.constexpr = kv_descs[0].block_type.shape[2]
        _load_three(q_descs, q_bar, (smem[0], smem[1], smem[2]), batch, head, q_row)
        for j in range(n_tiles):
            slot = j % NUM_STAGES
            mbarrier.wait(kv_empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
            tiles = (smem[3].index(slot), smem[4].index(slot), smem[5].index(slot))
            key = first_key + j * BLOCK_N
            if VARLEN and key + BLOCK_N > key_end:
                tail = kv_tail.index(0)
                _load_three(kv_descs, tail, tiles, batch, kv_head, key)
                mbarrier.wait(tail, 0)
                _zero_tail_rows(tiles, key_end - key)
                mbarrier.arrive(kv_ready.index(slot))
            else:
                _load_three(kv_descs, kv_ready.index(slot), tiles, batch, kv_head, key)

    @gluon.jit
    def _dq_wide_scores(
        smem, bars, scalars, modifiers, pointers, outputs, batch, head, BLOCK_N: gl.constexpr,
        BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr,
        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
        NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """The dQ kernel's default partition: the scores warpgroup's loop, then the stores of dQ's parts: TMA stores
        (``outputs = (dq_desc, dq2_desc, dq_ptr, stride_dq_row)``), or, for a block that the end of a packed
        sequence cuts, masked stores of its rows."""
        _dq_half(smem, bars, scalars, modifiers, pointers, 0, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL,
                 WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16)  # fmt: skip
        mbarrier.wait(bars[8], 0)  # halves_stored
        ROWS: gl.constexpr = smem[0].type.shape[2]
        start_m, seqlen_q, row_origin = scalars[0], scalars[1], scalars[9]
        dq_desc, dq2_desc, dq_ptr, stride_dq_row = outputs
        if VARLEN:  # (compile-time, as the dK/dV kernel's stores)
            if start_m + ROWS > seqlen_q:
                dq_row = dq_ptr + (row_origin + start_m).to(gl.int64) * stride_dq_row + head * (BLOCK_D + BLOCK_D2)
                kept = seqlen_q - start_m
                store_rows_below(smem[0].reshape([ROWS, BLOCK_D]), dq_row, stride_dq_row, kept, 4)
                store_rows_below(smem[1].reshape([ROWS, BLOCK_D2]), dq_row + BLOCK_D, stride_dq_row, kept, 4)
            else:
                tma_store(dq_desc, [batch, head, row_origin + start_m, 0], smem[0])
                tma_store(dq2_desc, [batch, head, row_origin + start_m, 0], smem[1])
        else:
            tma_store(dq_desc, [batch, head, start_m, 0], smem[0])
            tma_store(dq2_desc, [batch, head, start_m, 0], smem[1])
        tma.store_wait(0)

    @gluon.jit
    def _dq_wide_gradients(
        smem, bars, scalars, modifiers, pointers, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
        BLOCK_D2: gl.constexpr, BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NUM_STAGES: gl.constexpr,
        IS_FP16: gl.constexpr,
    ):  # fmt: skip
        _dq_half(smem, bars, scalars, modifiers, pointers, 1, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL,
                 WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16)  # fmt: skip

    @gluon.jit(do_not_specialize=[
        "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "window_left", "window_right",
        "stride_alibi_b", "stride_alibi_h", "total_q", "num_sequences", "search_steps",
    ])  # fmt: skip
    def attention_dq_wide_kernel(
        q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, dq_desc, dq2_desc, lse_ptr, lse2_ptr, delta_ptr,
        o_ptr, stride_ob, stride_oh, stride_om, do_ptr, stride_dob, stride_doh, stride_dom,
        num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, sm_scale, qk_scale, window_left, window_right,
        cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
        dq_ptr, stride_dq_row, total_q, cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_D2: gl.constexpr,
        BLOCK_DV: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        VARLEN: gl.constexpr,
    ):  # fmt: skip
        """dQ (and Delta, lse2) of one block of BLOCK_M = 64 rows of one (batch, head); grid: 1-d, ``num_m_blocks *
        B * H`` programs in ``q_block_tiles``' order, launched with 4 warps (the scores warpgroup) and given the
        gradients warpgroup and the producer warp by ``gl.warp_specialize``.  q, k and dq arrive in two column parts
        (BLOCK_D = 128 and BLOCK_D2 columns), v and do in one of BLOCK_DV; o and do are also read through their
        pointers and strides (Delta), lse (read), lse2 and Delta (written) are ``[B, H, Nq]`` float32 contiguous.
        WINDOW_LEFT / WINDOW_RIGHT, SOFTCAP, ALIBI: the score modifiers, as in the dK/dV kernel.
        VARLEN (a packed batch): as the D <= 128 dQ kernel (``backward_gluon_dq``) takes it: ``[1, H, total, D]``
        views, ``total_q // BLOCK_M + B`` slots per head, ``[H, total_q]`` statistics, and ``dq_ptr`` /
        ``stride_dq_row`` for the rows a TMA store may not write."""
        gl.static_assert(BLOCK_N == 64 and BLOCK_M == 64, "64-row Q blocks (one warpgroup's M), 64-key tiles")
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        problem = (num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k, window_left, window_right, alibi_ptr,
                   stride_alibi_b, stride_alibi_h, (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps),
                   (total_q, dq_ptr, stride_dq_row))  # fmt: skip
        (bh, _, head, kv_head, start_m, first_key, left_tiles, unmasked_tiles, n_tiles, slope2, seq_q, seq_k,
         packed) = q_block_tiles(gl.program_id(0), problem, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, ALIBI,
                                 VARLEN)  # fmt: skip
        if VARLEN:  # noqa: SIM102 - a compile-time branch around a runtime one
            if start_m >= seq_q:  # an idle slot of the packed grid
                return
        coord_batch, row_origin, key_origin = packed[0], packed[1], packed[2]
        stats, o_rows, do_rows = dq_row_pointers(
            bh, head, packed, seqlen_q, o_ptr, stride_ob, stride_oh, do_ptr, stride_dob, stride_doh, VARLEN
        )  # fmt: skip

        q_descs = (q_desc, q2_desc, do_desc)
        kv_descs = (k_desc, k2_desc, v_desc)
        smem, q_bar, kv_ready, kv_empty, exchange_bars, exchange = _wide_buffers(
            q_descs, kv_descs, NUM_STAGES, DTYPE, False
        )  # fmt: skip
        p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored = exchange
        if VARLEN:  # the sequence's last K/V tile, which the producer warp zeroes past the end before handing over
            kv_tail = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_tail.index(0), count=1)
            fence_async_shared()
        else:
            kv_tail = kv_ready  # not used
        bars = (q_bar, kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, loop_done, halves_stored)
        scalars = (start_m, seq_q, seq_k, first_key, left_tiles, unmasked_tiles, n_tiles, sm_scale, qk_scale,
                   row_origin)  # fmt: skip
        modifiers = (window_left, window_right, cap_in, cap_out, slope2)
        pointers = (o_rows, stride_om, do_rows, stride_dom, lse_ptr, lse2_ptr, delta_ptr, stats)
        outputs = (dq_desc, dq2_desc, dq_ptr, stride_dq_row)
        gl.warp_specialize(
            [
                (_dq_wide_scores, (smem, bars, scalars, modifiers, pointers, outputs, coord_batch, head, BLOCK_N,
                                   BLOCK_D, BLOCK_D2, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
                                   NUM_STAGES, IS_FP16, VARLEN)),
                (_dq_wide_gradients, (smem, bars, scalars, modifiers, pointers, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV,
                                      CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, NUM_STAGES, IS_FP16)),
                (_dq_wide_load_tiles, (q_descs, kv_descs, smem, q_bar, kv_ready, kv_empty, kv_tail, coord_batch, head,
                                       kv_head, row_origin + start_m, key_origin + first_key, n_tiles,
                                       key_origin + seq_k, NUM_STAGES, VARLEN)),
            ],
            [4, 1],
            [240, 24],
        )  # fmt: skip

        _invalidate_wide(q_bar, kv_ready, kv_empty, exchange_bars, NUM_STAGES)
        if VARLEN:
            mbarrier.invalidate(kv_tail.index(0))


# The (D, Dv) pairs the kernels are built for: q and k in two column parts, 128 + (D - 128); v, do in one tile.
WIDE_HEAD_DIMS = ((192, 128), (256, 256))


def wide_head_dim_parts(head_dim: int) -> tuple[int, int]:
    """The widths of the two column parts the wide kernels hold q, k and their gradients in: 128 and the rest."""
    return 128, head_dim - 128


def _check_wide_call(
    q: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int, num_stages: int, kernel: str
) -> None:  # fmt: skip
    """ValueError unless (D, Dv) is one of ``WIDE_HEAD_DIMS`` and the tiles are 64 x 64 in two ring slots (what both
    kernels are built for: at D = 256 a third 64 KB slot would not fit the shared memory)."""
    if (q.shape[-1], v.shape[-1]) not in WIDE_HEAD_DIMS:
        pairs = ", ".join(f"D = {d}, Dv = {dv}" for d, dv in WIDE_HEAD_DIMS)
        raise ValueError(
            f"the wide {kernel} kernel takes {pairs}, not D = {q.shape[-1]}, Dv = {v.shape[-1]}"
        )  # fmt: skip
    tile = WIDE_GLUON_TILE
    if (block_m, block_n, num_stages) != (tile.block_m, tile.block_n, tile.num_stages):
        raise ValueError(
            f"block_m={block_m}, block_n={block_n}, num_stages={num_stages}: the wide {kernel} kernel runs 64 x 64 "
            "tiles with two ring slots"
        )


def _modifier_args(modifiers: ScoreModifiers | None, q: torch.Tensor) -> tuple:
    """The score modifiers' arguments as both kernels take them after ``qk_scale``: ``(window_left, window_right,
    cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h)`` (``ScoreModifiers.args``; q stands in for the
    slopes where there are none)."""
    if modifiers is None:
        return 0, 0, 0.0, 0.0, q, 0, 0
    return modifiers.args[1:8]


def _modifier_flags(modifiers: ScoreModifiers | None) -> dict[str, bool]:
    """WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP (the hardware's tanh, as the kernels always take it) and ALIBI."""
    if modifiers is None:
        return dict(WINDOW_LEFT=False, WINDOW_RIGHT=False, SOFTCAP=False, ALIBI=False)
    flags = modifiers.flags
    return dict(
        WINDOW_LEFT=flags["WINDOW_LEFT"], WINDOW_RIGHT=flags["WINDOW_RIGHT"], SOFTCAP=flags["SOFTCAP"] != 0,
        ALIBI=flags["ALIBI"],
    )  # fmt: skip


def _part_descriptors(x: torch.Tensor, rows: int) -> tuple:
    """Descriptors of ``x``'s two column parts (views with x's strides, the second one's base 128 columns on)."""
    first = wide_head_dim_parts(x.shape[-1])[0]
    return tile_descriptor(x[..., :first], rows), tile_descriptor(x[..., first:], rows)


def attention_dkdv_wide_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    causal: bool,
    block_m: int = 64,
    block_n: int = 64,
    num_stages: int = 2,
    modifiers: ScoreModifiers | None = None,
    varlen: tuple | None = None,
    launch_key: tuple | None = None,
) -> None:
    """Write ``dk`` ``[B, Hkv, Nk, D]`` and ``dv`` ``[B, Hkv, Nk, Dv]`` (contiguous, dtype of q; summed over each
    head group).

    ``q`` ``[B, H, Nq, D]``, ``do`` ``[B, H, Nq, Dv]``, ``k`` ``[B, Hkv, Nk, D]``, ``v`` ``[B, Hkv, Nk, Dv]`` with
    (D, Dv) in ``WIDE_HEAD_DIMS``, in the scope that ``KernelVariant.DKDV.gluon_scope`` checks (any score
    modifiers, ``modifiers``); ``lse2`` and ``delta`` ``[B, H, Nq]`` float32 contiguous, as the dQ kernel writes
    them.

    ``varlen = (cu_seqlens_q, cu_seqlens_k, B, search_steps)``: a packed batch (``launch.PreparedCall.varlen_args``),
    q, do ``[total_q, H, *]``, k, v, dk, dv ``[total_k, Hkv, *]`` (dk, dv contiguous), lse2 and delta
    ``[H, total_q]``.

    ``launch_key``: the call's ``launch.PreparedCall.launch_key`` of the operands other than q, k, v and the
    launcher's fresh outputs (``compiled_launch``), or None.
    """
    dk_rows, dv_rows = dk, dv  # packed: the [total_k, Hkv, *] tensors that the masked stores address
    q, k, v, do, dk, dv, sequences = packed_views((q, k, v, do, dk, dv), {"dk": dk, "dv": dv}, varlen, lse2)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    _check_wide_call(q, v, block_m, block_n, num_stages, "dK/dV")
    num_n_blocks = grid_slots(Nk, block_n, varlen)
    first, second = wide_head_dim_parts(D)
    compiled_launch.launch(
        attention_dkdv_wide_kernel, (num_n_blocks * B * Hkv,), launch_key,
        *_part_descriptors(q, block_m), *_part_descriptors(k, block_n), tile_descriptor(v, block_n),
        tile_descriptor(do, block_m), *_part_descriptors(dk, block_n), tile_descriptor(dv, block_n), lse2, delta,
        H, Hkv, H // Hkv, Nq, Nk, num_n_blocks, scale, scale * LOG2E, *_modifier_args(modifiers, q),
        dk_rows, dv_rows, dk_rows.stride(0), dv_rows.stride(0), *sequences,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=first, BLOCK_D2=second, BLOCK_DV=Dv, CAUSAL=causal,
        **_modifier_flags(modifiers), NUM_STAGES=num_stages, IS_FP16=q.dtype == torch.float16,
        VARLEN=varlen is not None, num_warps=KERNEL_WARPS,
    )  # fmt: skip


def attention_dq_wide_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    scale: float,
    causal: bool,
    block_m: int = 64,
    block_n: int = 64,
    num_stages: int = 2,
    modifiers: ScoreModifiers | None = None,
    varlen: tuple | None = None,
    launch_key: tuple | None = None,
) -> None:
    """Write ``dq`` ``[B, H, Nq, D]`` (contiguous, dtype of q), and ``lse2`` (lse * log2(e), +inf on empty rows) and
    ``delta`` (rowsum(dO * O)) ``[B, H, Nq]`` float32 contiguous for the dK/dV kernel.

    ``q`` ``[B, H, Nq, D]``, ``o``, ``do`` ``[B, H, Nq, Dv]``, ``k`` ``[B, Hkv, Nk, D]``, ``v`` ``[B, Hkv, Nk, Dv]``
    with (D, Dv) in ``WIDE_HEAD_DIMS``, ``lse`` ``[B, H, Nq]`` (natural log, contiguous) in the scope that
    ``KernelVariant.DQ.gluon_scope`` checks (any score modifiers, ``modifiers``).

    ``varlen``: a packed batch as ``attention_dkdv_wide_hopper`` takes it: q, o, do, dq ``[total_q, H, *]`` (dq
    contiguous), k, v ``[total_k, Hkv, *]``, lse, lse2 and delta ``[H, total_q]``.

    ``launch_key``: as ``attention_dkdv_wide_hopper`` takes it.
    """
    dq_rows = dq  # packed: the [total_q, H, D] tensor that the masked stores address
    q, k, v, o, do, dq, sequences = packed_views((q, k, v, o, do, dq), {"dq": dq}, varlen, lse)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    _check_wide_call(q, v, block_m, block_n, num_stages, "dQ")
    if o.stride(-1) != 1 or do.stride(-1) != 1:
        raise ValueError("o and do must have contiguous rows (last stride 1)")
    num_m_blocks = grid_slots(Nq, block_m, varlen)
    first, second = wide_head_dim_parts(D)
    compiled_launch.launch(
        attention_dq_wide_kernel, (num_m_blocks * B * H,), launch_key,
        *_part_descriptors(q, block_m), *_part_descriptors(k, block_n), tile_descriptor(v, block_n),
        tile_descriptor(do, block_m), *_part_descriptors(dq, block_m), lse, lse2, delta,
        o, *o.stride()[:3], do, *do.stride()[:3],
        H, H // Hkv, Nq, Nk, num_m_blocks, scale, scale * LOG2E, *_modifier_args(modifiers, q),
        dq_rows, dq_rows.stride(0), Nq, *sequences,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=first, BLOCK_D2=second, BLOCK_DV=Dv, CAUSAL=causal,
        **_modifier_flags(modifiers), NUM_STAGES=num_stages, IS_FP16=q.dtype == torch.float16,
        VARLEN=varlen is not None, num_warps=KERNEL_WARPS,
    )  # fmt: skip
