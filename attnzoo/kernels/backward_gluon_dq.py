"""The dQ kernel of the two-kernel backward for Hopper, written in Gluon: each K/V tile's exponentials run while the
tensor cores do that tile's dP and the previous tile's dQ.

``backward_2kernel.py``'s Triton dQ kernel waits for ``S = Q K^T`` and ``dP = dO V^T`` before its arithmetic and
for the arithmetic before ``dQ += dS K``.  Here each warpgroup (64 query rows) issues its products asynchronously
and carries one tile's dS into the next iteration.  Iteration ``j``, with ``P = exp2(S * scale * log2(e) - lse2)``
and ``dS = P * (dP - Delta)``, entered with ``dS_{j-1}`` in registers:

    issue  S_j = Q K_j^T,  dQ += dS_{j-1} K_{j-1},  dP_j = dO V_j^T     (asynchronous, in this order)
    wait until two products are in flight -> S_j done
    P_j = exp2(...)                              (while the tensor cores run dQ and dP_j)
    wait for both; dS_j = P_j * (dP_j - Delta)   (as the left operand of the next dQ product, in registers)

It is the forward's loop (``forward_gluon.py``) with the online softmax replaced by the stored ``lse2`` and a third
product.  Only dS crosses the iteration (16 registers of 16-bit values per thread for a 64 x 64 tile, where P and dP
would hold 64 of float32): the warpgroups of the warp-specialised block run at the 248 and 232 registers that
``setmaxnreg`` gives them (the forward's split), and the loop uses 195 at D = 128.  As in the forward, a block
of 64 rows is one warpgroup that refills its K/V slots itself; a block of 128 rows is two warpgroups and a producer
warp (``gl.warp_specialize``) that loads every tile, and the warpgroups drift apart, so that one's arithmetic runs
under the other's products.  Q and dO are resident (one TMA load each); K and V stream through rings of NUM_STAGES
slots, a V slot free once ``dP`` has read it and a K slot one iteration later, once ``dQ`` has.  The kernel also
writes, for the dK/dV kernel that runs next, ``Delta = rowsum(dO * O)`` (one extra load of the O rows) and ``lse2``
(lse in base 2, +inf on an empty row), as the Triton dQ kernel does.  On the H100 the 128-row tile won every D = 128
dQ key of its tuning (the best Triton tile 1.06-1.18x its time) and ran the whole backward 1.00-1.12x faster than
the Triton dQ tiles did (docs/design.md).

Padding: TMA reads zeros past Nq and Nk; rows past Nq get lse2 = +inf (P = 0) and a dQ row that the TMA store
drops; keys past Nk are masked like the causal diagonal (their zero scores would otherwise give P = exp2(-lse2),
which may overflow the 16-bit dS).  Packed batches (VARLEN) run on ``[1, H, total, D]`` views, one Q block of one
sequence per program: the K/V box of a sequence's last tile reaches into the next sequence's rows, which are zeroed
in shared memory before the tile's products (their P is 0, but 0 * NaN is not), and a dQ slab that the sequence's
end cuts leaves by masked stores.

Scope (``KernelVariant.DQ.gluon_scope`` in ``launch.py``): D = Dv = 64 or 128, float16/bfloat16, causal masks,
sliding windows, the soft cap, ALiBi, grouped-query heads and packed batches; not ``seqlens_k`` (K and V rows past
it may hold NaN, which ``dP`` and ``dS K`` would carry into dQ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import compiled_launch
from .common import LOG2E, softcap_scores, softcap_tanh_scale
from .forward_gluon import KERNEL_WARPS
from .gluon_hopper import (
    accumulator_layout,
    check_warpgroup_rows,
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    grid_slots,
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

if TYPE_CHECKING:
    from .launch import ScoreModifiers

if gluon is not None:  # (a Triton without Gluon: forward_gluon defines no kernel helpers either)
    from .forward_gluon import alibi_key_term, mask_scores, q_block_tiles

    @gluon.jit
    def _tile_p(
        s, lse2, rows, keys, diagonal_offset, seqlen_k, qk_scale, modifiers, alibi_cols, masked,
        CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr,
    ):  # fmt: skip
        """``P`` of one raw score tile ``s`` ``[BLOCK_M, BLOCK_N]`` from the rows' ``lse2``, and the soft cap's
        derivative ``1 - tanh^2`` (1.0, unread, without SOFTCAP).  ``masked``: the tile is cut by the diagonal, a
        window's edge or Nk, and its hidden keys get ``P = 0`` (``forward_gluon.mask_scores``).  ALiBi with a
        causal mask as the Gluon forward takes it (``forward_gluon._modified_scores``): ``alibi_cols`` is the
        keys' term ``slope (j - r0)``, one add per score, and the rows' term ``slope (i' - r0)`` is in ``lse2``."""
        window_left, window_right, cap_in, cap_out, slope2 = modifiers
        if SOFTCAP:
            s2, dcap = softcap_scores(s, softcap_tanh_scale(qk_scale, cap_in), cap_out, 2)
        else:
            s2, dcap = s * qk_scale, 1.0
        if ALIBI:
            if CAUSAL:  # (keys right of the diagonal get a wrong score; the mask below hides them)
                s2 = s2 + alibi_cols[None, :]
            else:
                # -slope |i' - j| from the exact integer distance (keys and positions may be 10^4 apart: a
                # difference of two float32 products would lose the small distances' digits).
                offset = keys[None, :] - (rows + diagonal_offset)[:, None]
                s2 = s2 - slope2 * gl.abs(offset).to(gl.float32)
        if masked:
            s2 = mask_scores(
                s2, rows, keys, diagonal_offset, seqlen_k, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT
            )  # fmt: skip
        return gl.exp2(s2 - lse2[:, None]), dcap

    @gluon.jit
    def _alibi_split(
        lse2, rows, start_m, diagonal_offset, local_keys, slope2, CAUSAL: gl.constexpr, ALIBI: gl.constexpr
    ):  # fmt: skip
        """ALiBi with a causal mask for the ``rows`` of a block from ``start_m`` -> ``(lse2_p, alibi_origin,
        alibi_local)``: ``-slope (i' - j) = slope (j - r0) - slope (i' - r0)``, r0 the first row's position
        (``alibi_origin``).  The rows' term, constant along a row, joins the lse2 that P is taken from (``lse2_p``;
        the stored lse2 is unchanged); the keys' term is one add per score (``_tile_p``, from ``alibi_local =
        slope2 * (0..BLOCK_N-1)`` by ``alibi_key_term``), where ``|i' - j|`` took a subtraction, a conversion and a
        multiply-add.  Both terms are small where P is not negligible (rows within 64 of r0, keys near the rows).
        Without it (or without CAUSAL) ``lse2_p`` is ``lse2``."""
        alibi_origin = start_m + diagonal_offset
        alibi_local = slope2 * local_keys.to(gl.float32)
        if ALIBI and CAUSAL:
            lse2_p = lse2 + slope2 * (rows - start_m).to(gl.float32)
        else:
            lse2_p = lse2
        return lse2_p, alibi_origin, alibi_local

    @gluon.jit
    def dq_row_pointers(
        bh, head, packed, seqlen_q, o_ptr, stride_ob, stride_oh, do_ptr, stride_dob, stride_doh, VARLEN: gl.constexpr
    ):  # fmt: skip
        """A Q-stationary program's ``(stats, o_rows, do_rows)`` for ``_row_stats``: the statistics' offset of the
        head's row 0 (dense ``[B, H, Nq]``: ``bh * Nq``; VARLEN ``[H, total_q]``: from the sequence's first row) and
        the head's row 0 of o and do (VARLEN: of the ``[1, H, total, D]`` views, whose rows the program offsets by
        its sequence's origin).  ``packed`` as ``q_block_tiles`` returns it."""
        if VARLEN:
            stats = head.to(gl.int64) * packed[3] + packed[1]  # total_q, row_origin
            o_rows = o_ptr + head.to(gl.int64) * stride_oh
            do_rows = do_ptr + head.to(gl.int64) * stride_doh
        else:
            batch = packed[0]
            stats = bh.to(gl.int64) * seqlen_q
            o_rows = o_ptr + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
            do_rows = do_ptr + batch.to(gl.int64) * stride_dob + head.to(gl.int64) * stride_doh
        return stats, o_rows, do_rows

    @gluon.jit
    def _row_stats(
        o_rows, stride_o_row, do_rows, stride_do_row, lse_ptr, lse2_ptr, delta_ptr, stats, first_row, start_m,
        seqlen_q, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):  # fmt: skip
        """Delta = rowsum(dO * O) and lse2 of the block's rows, stored for the dK/dV kernel and returned in the row
        layout of a ``[BLOCK_M, *]`` tile (the caller converts them).  ``o_rows``/``do_rows``: the head's row 0 of
        o and do, rows ``stride_*_row`` apart; the block's rows start at ``first_row`` of them (its ``start_m``
        within the sequence); ``stats``: the statistics' offset of the head's row 0.  Rows past ``seqlen_q`` get
        Delta = 0, lse2 = +inf (P = 0) and are not stored."""
        LANE_COLS: gl.constexpr = 32 if BLOCK_D // 8 > 32 else BLOCK_D // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANE_COLS, LANE_COLS], [NUM_WARPS, 1], [1, 0])
        local = gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_D, gl.SliceLayout(0, layout))
        real = (start_m + local) < seqlen_q
        row = (first_row + local).to(gl.int64)
        o_tile = gl.load(o_rows + row[:, None] * stride_o_row + cols[None, :], mask=real[:, None], other=0.0)
        do_tile = gl.load(do_rows + row[:, None] * stride_do_row + cols[None, :], mask=real[:, None], other=0.0)
        delta = gl.sum(o_tile.to(gl.float32) * do_tile.to(gl.float32), 1)
        at = stats + start_m + local
        gl.store(delta_ptr + at, delta, mask=real)
        lse = gl.load(lse_ptr + at, mask=real, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        gl.store(lse2_ptr + at, lse2, mask=real)
        return delta, lse2

    @gluon.jit
    def _dq_operand(p, dp, delta, dcap, DTYPE: gl.constexpr, operand_layout: gl.constexpr, SOFTCAP: gl.constexpr):
        """``dS = P * (dP - Delta)`` (times the soft cap's derivative) as the left operand of ``dQ += dS K``, in
        registers: 16 per thread for a 64 x 64 tile, where P and dP held 64 (what a warpgroup carries from one
        iteration to the next)."""
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap
        return gl.convert_layout(ds.to(DTYPE), operand_layout)

    @gluon.jit
    def _dq_rows(
        k_desc, v_desc, dq_desc, smem, bars, scalars, pointers, modifiers, packed,
        WARPGROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
        NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr, INLINE_LOADS: gl.constexpr, WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """dQ, Delta and lse2 of the 64 rows of warpgroup ``WARPGROUP`` of the Q block (4 warps; the loop of the
        module docstring).  INLINE_LOADS: this warpgroup refills the K/V slots itself (the whole block is one
        warpgroup); else it releases each slot to the producer warp (``_dq_load_tiles``) with an arrive on its
        "empty" mbarrier: a V slot once ``dP`` has read it, a K slot once ``dQ`` has.

        ``scalars = (head, kv_head, start_m, seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles,
        sm_scale, qk_scale)``: tile ``j`` holds keys ``first_key + j * BLOCK_N ..``; tiles ``j < left_tiles`` and
        ``j >= unmasked_tiles`` take the mask.  ``pointers = (o, stride_o_row, do, stride_do_row, lse, lse2, delta,
        stats)``: the head's row 0 of o and do (``_row_stats``), the statistics and their offset.  ``packed`` as
        ``forward_gluon._attend_rows`` takes it, with dQ's pointer and row stride for the masked stores."""
        q_smem, do_smem, k_ring, v_ring = smem
        q_bars, k_ready, v_ready, k_empty, v_empty = bars
        (head, kv_head, start_m, seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles, sm_scale,
         qk_scale) = scalars  # fmt: skip
        o_rows, stride_o_row, do_rows, stride_do_row, lse_ptr, lse2_ptr, delta_ptr, stats = pointers
        coord_batch, row_origin, key_origin, _, dq_ptr, stride_dq_row = packed
        ROWS: gl.constexpr = q_smem.type.shape[3]
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        # Accumulator layouts: S and dP [64, BLOCK_N], dQ [64, BLOCK_D] (a thread holds 2 of the 64 rows); dS goes
        # from the first layout's registers into the second's left operand (no shared memory).
        s_layout: gl.constexpr = accumulator_layout(4, BLOCK_N)
        dq_layout: gl.constexpr = accumulator_layout(4, BLOCK_D)
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        start_m = start_m + WARPGROUP * ROWS
        delta, lse2 = _row_stats(
            o_rows, stride_o_row, do_rows, stride_do_row, lse_ptr, lse2_ptr, delta_ptr, stats, row_origin + start_m,
            start_m, seqlen_q, ROWS, BLOCK_D, 4,
        )  # fmt: skip
        delta = gl.convert_layout(delta, row_layout)
        lse2 = gl.convert_layout(lse2, row_layout)
        diagonal_offset = seqlen_k - seqlen_q
        rows = start_m + gl.arange(0, ROWS, row_layout)
        local_keys = gl.arange(0, BLOCK_N, key_layout)
        slope2 = modifiers[4]
        lse2_p, alibi_origin, alibi_local = _alibi_split(
            lse2, rows, start_m, diagonal_offset, local_keys, slope2, CAUSAL, ALIBI
        )  # fmt: skip
        last_tail = seqlen_k - (first_key + (n_tiles - 1) * BLOCK_N)  # keys of the last tile in the sequence
        mbarrier.wait(q_bars.index(WARPGROUP), 0)
        q_tile = q_smem.index(WARPGROUP).reshape([ROWS, BLOCK_D])
        do_tile = do_smem.index(WARPGROUP).reshape([ROWS, BLOCK_D])

        # Tile 0: S and dP, nothing to overlap with yet but each other.
        k_tile = ring_wait(k_ready, k_ring, 0, BLOCK_N, BLOCK_D, NUM_STAGES)
        v_tile = ring_wait(v_ready, v_ring, 0, BLOCK_N, BLOCK_D, NUM_STAGES)
        if VARLEN and INLINE_LOADS:  # noqa: SIM102 - the producer warp zeroes them otherwise
            if (n_tiles == 1) & (last_tail < BLOCK_N):
                _zero_tail_rows(k_tile, v_tile, last_tail)
        s = warpgroup_mma(
            q_tile, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False,
            is_async=True,
        )  # fmt: skip
        dp = warpgroup_mma(
            do_tile, v_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False,
            is_async=True,
        )  # fmt: skip
        s = warpgroup_mma_wait(1, deps=(s,))
        p, dcap = _tile_p(
            s, lse2_p, rows, first_key + local_keys, diagonal_offset, seqlen_k, qk_scale, modifiers,
            alibi_key_term(alibi_local, first_key, alibi_origin, slope2, CAUSAL, ALIBI),
            (unmasked_tiles == 0) | (left_tiles > 0), CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
        )  # fmt: skip
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds_op = _dq_operand(p, dp, delta, dcap, DTYPE, operand_layout, SOFTCAP)
        if INLINE_LOADS:
            # Every warp is past dP_0: V slot 0 takes the tile NUM_STAGES ahead.
            cta_barrier()
            ring_load(v_desc, v_ready, v_ring, NUM_STAGES, coord_batch, kv_head,
                      key_origin + first_key + NUM_STAGES * BLOCK_N, n_tiles > NUM_STAGES, NUM_STAGES)  # fmt: skip
        else:
            mbarrier.arrive(v_empty.index(0))
        dq = gl.zeros([ROWS, BLOCK_D], gl.float32, dq_layout)

        for j in range(1, n_tiles):
            k_next = ring_wait(k_ready, k_ring, j, BLOCK_N, BLOCK_D, NUM_STAGES)
            v_next = ring_wait(v_ready, v_ring, j, BLOCK_N, BLOCK_D, NUM_STAGES)
            if VARLEN and INLINE_LOADS:  # noqa: SIM102
                if (j == n_tiles - 1) & (last_tail < BLOCK_N):
                    _zero_tail_rows(k_next, v_next, last_tail)
            # The last S tile's registers serve as the (ignored) accumulator input: no zero tile per iteration.
            s = warpgroup_mma(q_tile, k_next.permute((1, 0)), s, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
            dp = warpgroup_mma(do_tile, v_next.permute((1, 0)), dp, use_acc=False, is_async=True)
            # wgmma groups complete in order: two outstanding means S_j is done, dQ and dP_j may still run.
            s = warpgroup_mma_wait(2, deps=(s,))
            p, dcap = _tile_p(
                s, lse2_p, rows, first_key + j * BLOCK_N + local_keys, diagonal_offset, seqlen_k, qk_scale, modifiers,
                alibi_key_term(alibi_local, first_key + j * BLOCK_N, alibi_origin, slope2, CAUSAL, ALIBI),
                (j >= unmasked_tiles) | (j < left_tiles), CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
            )  # fmt: skip
            # dS_{j-1} stays alive (the product reads it from registers) until this wait.
            dq, dp, ds_op = warpgroup_mma_wait(0, deps=(dq, dp, ds_op))
            ds_op = _dq_operand(p, dp, delta, dcap, DTYPE, operand_layout, SOFTCAP)
            if INLINE_LOADS:
                # Every warp is past dQ_{j-1} (K slot j - 1) and dP_j (V slot j): refill them NUM_STAGES ahead.
                cta_barrier()
                k_refill = j - 1 + NUM_STAGES
                v_refill = j + NUM_STAGES
                ring_load(k_desc, k_ready, k_ring, k_refill, coord_batch, kv_head,
                          key_origin + first_key + k_refill * BLOCK_N, k_refill < n_tiles, NUM_STAGES)  # fmt: skip
                ring_load(v_desc, v_ready, v_ring, v_refill, coord_batch, kv_head,
                          key_origin + first_key + v_refill * BLOCK_N, v_refill < n_tiles, NUM_STAGES)  # fmt: skip
            else:
                # A wgmma is one operation of the whole warpgroup: once complete in this thread, it has read its
                # shared memory for all four warps, so one arrive per warpgroup frees the slot.
                mbarrier.arrive(k_empty.index((j - 1) % NUM_STAGES))
                mbarrier.arrive(v_empty.index(j % NUM_STAGES))
            k_tile = k_next

        dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))

        # dQ leaves through this warpgroup's Q rows, which the products no longer read: one TMA store (rows past
        # Nq are dropped by the copy engine), or, for a slab that the end of a packed sequence cuts, masked stores
        # of its own rows.
        q_slot = q_smem.index(WARPGROUP)
        cta_barrier()  # every warp is past the waits of the products that read Q
        q_slot.reshape([ROWS, BLOCK_D]).store((dq * sm_scale).to(DTYPE))
        fence_async_shared()
        cta_barrier()
        if VARLEN:
            if start_m + ROWS > seqlen_q:
                first = dq_ptr + (row_origin + start_m).to(gl.int64) * stride_dq_row + head * BLOCK_D
                store_rows_below(q_slot.reshape([ROWS, BLOCK_D]), first, stride_dq_row, seqlen_q - start_m, 4)
            else:
                tma_store(dq_desc, [coord_batch, head, row_origin + start_m, 0], q_slot)
        else:
            tma_store(dq_desc, [coord_batch, head, start_m, 0], q_slot)
        tma.store_wait(0)

    @gluon.jit
    def _zero_tail_rows(k_tile, v_tile, first_zero):
        """Zero the rows of a sequence's last K and V tiles past its end (``zero_rows_from``; one warpgroup), so that
        the next sequence's values never meet the products: P is 0 there, but 0 * NaN is not."""
        zero_rows_from(k_tile, first_zero, 4)
        zero_rows_from(v_tile, first_zero, 4)
        cta_barrier()

    @gluon.jit
    def _dq_load_tiles(
        q_desc, do_desc, k_desc, v_desc, smem, bars, kv_tail, coord_batch, head, kv_head, first_row, first_key,
        n_tiles, key_end, NUM_WARPGROUPS: gl.constexpr, NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """The producer warp of the warp-specialised block: each warpgroup's Q and dO rows, then K and V tile ``i``
        into their slots as soon as every warpgroup has released the slots' previous tiles.  ``first_row`` and
        ``first_key`` are TMA coordinates (packed: rows of the whole tensor).  VARLEN: the tiles that reach past the
        sequence's last key ``key_end`` (at most the last one) land on ``kv_tail`` instead; this warp zeroes their
        rows past the sequence and only then completes the slots' "ready" barriers (plain arrives)."""
        q_smem, do_smem, k_ring, v_ring = smem
        q_bars, k_ready, v_ready, k_empty, v_empty = bars
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_D: gl.constexpr = k_desc.block_type.shape[3]
        for w in gl.static_range(NUM_WARPGROUPS):
            ring_load_pair(q_desc, do_desc, q_bars, q_smem, do_smem, w, coord_batch, head, first_row + w * ROWS,
                           True, NUM_WARPGROUPS)  # fmt: skip
        for i in range(n_tiles):
            slot = i % NUM_STAGES
            # An mbarrier starts as if its phase "-1" had completed, so the waits of the first round pass at once.
            free_phase = ((i // NUM_STAGES) & 1) ^ 1
            key = first_key + i * BLOCK_N
            if VARLEN and key + BLOCK_N > key_end:
                mbarrier.wait(k_empty.index(slot), free_phase)
                mbarrier.wait(v_empty.index(slot), free_phase)
                tail = kv_tail.index(0)
                mbarrier.expect(tail, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma_load(k_desc, [coord_batch, kv_head, key, 0], tail, k_ring.index(slot))
                tma_load(v_desc, [coord_batch, kv_head, key, 0], tail, v_ring.index(slot))
                mbarrier.wait(tail, 0)
                zero_rows_from(k_ring.index(slot).reshape([BLOCK_N, BLOCK_D]), key_end - key, 1)
                zero_rows_from(v_ring.index(slot).reshape([BLOCK_N, BLOCK_D]), key_end - key, 1)
                mbarrier.arrive(k_ready.index(slot))
                mbarrier.arrive(v_ready.index(slot))
            else:
                mbarrier.wait(k_empty.index(slot), free_phase)
                ring_load(k_desc, k_ready, k_ring, i, coord_batch, kv_head, key, True, NUM_STAGES)
                mbarrier.wait(v_empty.index(slot), free_phase)
                ring_load(v_desc, v_ready, v_ring, i, coord_batch, kv_head, key, True, NUM_STAGES)

    @gluon.jit(do_not_specialize=[
        "num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks", "window_left", "window_right",
        "stride_alibi_b", "stride_alibi_h", "total_q", "num_sequences", "search_steps",
    ])  # fmt: skip
    def attention_dq_hopper_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, lse2_ptr, delta_ptr,
        o_ptr, stride_ob, stride_oh, stride_om, do_ptr, stride_dob, stride_doh, stride_dom,
        num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, sm_scale, qk_scale,
        window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h,
        dq_ptr, stride_dq_row, total_q, cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps,
        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, NUM_WARPGROUPS: gl.constexpr,
        NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """dQ (and Delta, lse2) of one Q block of NUM_WARPGROUPS * 64 rows of one (batch, head); grid: 1-d,
        num_m_blocks * B * H programs (as ``backward_2kernel.dq_kernel``); launched with 4 warps (the first
        warpgroup).  One warpgroup refills its K/V slots itself; with two, the block is warp-specialised as the
        forward's 128-row block is: the second warpgroup and a producer warp join as worker partitions, and the
        warpgroups drift apart so that one's arithmetic runs under the other's products.

        Descriptors are 4-d over ``[B, H, N, D]`` with ``[1, 1, 64, D]`` boxes for q, do and dq and ``[1, 1,
        BLOCK_N, D]`` for k and v.  lse (read), lse2 and Delta (written) are ``[B, H, Nq]`` float32 contiguous; o and
        do are also read through their pointers and strides (the O rows for Delta).
        VARLEN (a packed batch): the descriptors and strides are those of ``[1, H, total, D]`` views, the grid has
        ``num_m_blocks = total_q // BLOCK_M + B`` slots per head (``common.varlen_block``; idle slots return at
        once), the statistics are ``[H, total_q]``, and ``dq_ptr``/``stride_dq_row`` address the packed dQ for the
        rows a TMA store may not write.
        WINDOW_LEFT/WINDOW_RIGHT, SOFTCAP, ALIBI: the score modifiers as in ``backward_gluon``'s dK/dV kernel; the
        loop runs over the K/V tiles some row of the block sees (``common.kv_loop_bounds``), and those that the
        diagonal, a window's edge or Nk cut take the mask.
        """
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        gl.static_assert(ROWS == 64, "q/do/dq boxes of one warpgroup's 64 rows")
        # Iteration j reads K_{j-1} (dQ) and K_j (S): the ring holds two tiles at least.
        gl.static_assert(NUM_STAGES >= 2, "the K/V ring needs at least two slots")
        BLOCK_M: gl.constexpr = ROWS * NUM_WARPGROUPS
        problem = (num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k, window_left, window_right,
                   alibi_ptr, stride_alibi_b, stride_alibi_h, (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps),
                   (total_q, dq_ptr, stride_dq_row))  # fmt: skip
        (bh, _, head, kv_head, start_m, first_key, left_tiles, unmasked_tiles, n_tiles, slope2, seqlen_q, seqlen_k,
         packed) = q_block_tiles(gl.program_id(0), problem, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                                 ALIBI, VARLEN)  # fmt: skip
        if VARLEN:  # noqa: SIM102 - a compile-time branch around a runtime one
            if start_m >= seqlen_q:  # an idle slot of the packed grid
                return
        coord_batch, row_origin, key_origin = packed[0], packed[1], packed[2]
        stats, o_rows, do_rows = dq_row_pointers(
            bh, head, packed, seqlen_q, o_ptr, stride_ob, stride_oh, do_ptr, stride_dob, stride_doh, VARLEN
        )  # fmt: skip

        q_smem = gl.allocate_shared_memory(DTYPE, [NUM_WARPGROUPS, 1, 1, ROWS, BLOCK_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(DTYPE, [NUM_WARPGROUPS, 1, 1, ROWS, BLOCK_D], do_desc.layout)
        k_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
        v_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_WARPGROUPS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        kv_tail = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(NUM_WARPGROUPS):
            mbarrier.init(q_bars.index(w), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WARPGROUPS)  # one arrive per warpgroup frees a slot
            mbarrier.init(v_empty.index(i), count=NUM_WARPGROUPS)
        mbarrier.init(kv_tail.index(0), count=1)
        fence_async_shared()

        smem = (q_smem, do_smem, k_ring, v_ring)
        bars = (q_bars, k_ready, v_ready, k_empty, v_empty)
        scalars = (head, kv_head, start_m, seqlen_q, seqlen_k, first_key, left_tiles, unmasked_tiles, n_tiles,
                   sm_scale, qk_scale)  # fmt: skip
        pointers = (o_rows, stride_om, do_rows, stride_dom, lse_ptr, lse2_ptr, delta_ptr, stats)
        modifiers = (window_left, window_right, cap_in, cap_out, slope2)
        if NUM_WARPGROUPS == 1:
            # Prologue loads: Q and dO, then K and V tiles 0 .. NUM_STAGES-1 (the refill schedule of _dq_rows takes
            # over from there).
            ring_load_pair(q_desc, do_desc, q_bars, q_smem, do_smem, 0, coord_batch, head, row_origin + start_m, True,
                           1)  # fmt: skip
            for i in gl.static_range(NUM_STAGES):
                key = key_origin + first_key + i * BLOCK_N
                ring_load(k_desc, k_ready, k_ring, i, coord_batch, kv_head, key, i < n_tiles, NUM_STAGES)
                ring_load(v_desc, v_ready, v_ring, i, coord_batch, kv_head, key, i < n_tiles, NUM_STAGES)
            _dq_rows(k_desc, v_desc, dq_desc, smem, bars, scalars, pointers, modifiers, packed,
                     0, BLOCK_N, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI,
                     VARLEN)  # fmt: skip
        else:
            gl.static_assert(NUM_WARPGROUPS == 2, "one or two warpgroups per Q block")
            # Constexpr arguments go to the partitions as literals (forward_gluon's note: a constexpr held in a
            # variable would reach a worker partition as a runtime value in Triton 3.6).
            gl.warp_specialize(
                [
                    (_dq_rows, (k_desc, v_desc, dq_desc, smem, bars, scalars, pointers, modifiers, packed,
                                0, BLOCK_N, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, False, WINDOW_LEFT, WINDOW_RIGHT,
                                SOFTCAP, ALIBI, VARLEN)),
                    (_dq_rows, (k_desc, v_desc, dq_desc, smem, bars, scalars, pointers, modifiers, packed,
                                1, BLOCK_N, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, False, WINDOW_LEFT, WINDOW_RIGHT,
                                SOFTCAP, ALIBI, VARLEN)),
                    (_dq_load_tiles, (q_desc, do_desc, k_desc, v_desc, smem, bars, kv_tail, coord_batch, head,
                                      kv_head, row_origin + start_m, key_origin + first_key, n_tiles,
                                      key_origin + seqlen_k, NUM_WARPGROUPS, NUM_STAGES, VARLEN)),
                ],
                [4, 1],
                [232, 24],
            )  # fmt: skip

        for w in gl.static_range(NUM_WARPGROUPS):
            mbarrier.invalidate(q_bars.index(w))
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_empty.index(i))
        mbarrier.invalidate(kv_tail.index(0))


def attention_dq_hopper(
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
    modifiers: ScoreModifiers,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    varlen: tuple | None = None,
    launch_key: tuple | None = None,
) -> None:
    """Write ``dq`` ``[B, H, Nq, D]`` (contiguous, dtype of q), and ``lse2`` (lse * log2(e), +inf on empty rows) and
    ``delta`` (rowsum(dO * O)) ``[B, H, Nq]`` float32 contiguous for the dK/dV kernel.

    ``q``, ``o``, ``do`` ``[B, H, Nq, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]``, ``lse`` ``[B, H, Nq]`` (the forward's,
    natural log, contiguous), in the scope that ``KernelVariant.DQ.gluon_scope`` (``launch.py``) checks.

    ``varlen = (cu_seqlens_q, cu_seqlens_k, B, search_steps)``: a packed batch (``launch.PreparedCall.varlen_args``),
    q, o, do, dq ``[total_q, H, D]`` (dq contiguous), k, v ``[total_k, Hkv, D]``, lse, lse2 and delta ``[H,
    total_q]``.

    ``launch_key``: the call's ``launch.PreparedCall.launch_key`` of the operands other than q, k, v and the
    launcher's fresh outputs (``compiled_launch``), or None.
    """
    if num_stages < 2:  # iteration j reads K_{j-1} (its dQ product) and K_j (S): one slot would wait forever
        raise ValueError(f"num_stages={num_stages}: the dQ kernel's K/V ring needs at least 2 slots")
    dq_rows = dq  # packed: the [total_q, H, D] tensor that the masked stores address
    q, k, v, o, do, dq, sequences = packed_views((q, k, v, o, do, dq), {"dq": dq}, varlen, lse)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    check_warpgroup_rows(block_m, num_warps)
    if o.stride(-1) != 1 or do.stride(-1) != 1:
        raise ValueError("o and do must have contiguous rows (last stride 1)")
    num_m_blocks = grid_slots(Nq, block_m, varlen)
    programs = num_m_blocks * B * H  # (packed: B = 1, the views' batch)
    compiled_launch.launch(
        attention_dq_hopper_kernel, (programs,), launch_key,
        tile_descriptor(q, 64), tile_descriptor(k, block_n), tile_descriptor(v, block_n), tile_descriptor(do, 64),
        tile_descriptor(dq, 64), lse, lse2, delta,
        o, *o.stride()[:3], do, *do.stride()[:3],
        H, H // Hkv, Nq, Nk, num_m_blocks, scale, scale * LOG2E, *modifiers.args[1:8],
        dq_rows, dq_rows.stride(0), Nq, *sequences,
        BLOCK_N=block_n, BLOCK_D=D, CAUSAL=causal, NUM_WARPGROUPS=block_m // 64, NUM_STAGES=num_stages,
        IS_FP16=q.dtype == torch.float16, WINDOW_LEFT=modifiers.flags["WINDOW_LEFT"],
        WINDOW_RIGHT=modifiers.flags["WINDOW_RIGHT"], SOFTCAP=modifiers.flags["SOFTCAP"] != 0,
        ALIBI=modifiers.flags["ALIBI"], VARLEN=varlen is not None, num_warps=KERNEL_WARPS,
    )  # fmt: skip
