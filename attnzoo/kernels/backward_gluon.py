"""The dK/dV kernel of the two-kernel backward for Hopper, written in Gluon: the softmax-gradient arithmetic of one
Q tile runs while the tensor cores do that tile's other products.

``backward_2kernel.py``'s Triton dK/dV kernel waits for both ``S^T = K Q^T`` and ``dP^T = V dO^T`` before any of
its arithmetic, and for the arithmetic before issuing ``dV`` and ``dK``: on the H100 its tensor pipe was busy 59% of
the time (ncu, fp16 D=128 8k; the dQ kernel 70%), at 507-520 executed TFLOP/s against the dQ kernel's 561-608
(docs/design.md).  Here each warpgroup issues its products asynchronously and waits for each only where its
result is needed, so that one product always runs under the arithmetic.  Iteration ``t`` (Q tile ``t`` of the
K/V block's loop), with ``P = exp2(S * scale * log2(e) - lse2)`` and ``dS = P * (dP - Delta)``:

    issue  S^T_t = K Q_t^T,  dP^T_t = V dO_t^T       (asynchronous, in this order)
    wait until one product is in flight -> S^T_t done
    P^T_t = exp2(...)                                (while the tensor cores run dP^T_t)
    issue  dV += P^T_t dO_t
    wait until one product is in flight -> dP^T_t done
    dS^T_t = P^T_t * (dP^T_t - Delta_t)              (while the tensor cores run dV)
    issue  dK += dS^T_t Q_t; wait for it

As in the Triton kernel the tiles are transposed (keys along the rows), so P^T and dS^T leave the arithmetic in the
registers of the left operand of ``dV`` and ``dK``: no shared-memory round trip.  K and V are resident (one TMA
load); Q and dO tiles stream through two rings of NUM_STAGES slots, slot ``i`` of both completing on one mbarrier
when their bytes have landed, and a slot is refilled once every warpgroup has waited for the products that read it:
in a block of one warpgroup (64 keys) by that warpgroup after a barrier of its warps; in a block of 128 keys by a
producer warp (``gl.warp_specialize``) once both warpgroups have released the slot, the warpgroups otherwise free
to drift apart (WARP_SPECIALIZED).  lse2 (lse in base 2, +inf for an empty row) and Delta come from the
dQ kernel, which runs first; each iteration loads the next tile's into a two-slot shared-memory buffer, from which
the arithmetic reads them (fewer registers live than the per-tile loads, whose latency it also hides).

Padding needs no predicate: TMA reads zeros for Q and dO rows past Nq, so those rows contribute nothing (and their
lse2 loads as +inf), and K/V rows past Nk give gradient rows that the TMA store drops (with DQ_ATOMIC their dQ shares
are masked: see the kernel).  Only the tiles on the causal
diagonal and the window's edges apply a mask.  On the H100 the whole backward ran 1.02-1.07x faster than with the
best Triton dK/dV tile at D=128 and 0.84-0.96x at D=64 (fp16; the autotuner chooses; docs/design.md).

Scope (``KernelVariant.DKDV.gluon_scope`` in ``launch.py``): D = 64 or 128, sliding windows, the soft cap and ALiBi,
dO addressable by TMA.  ``seqlens_k`` is out of it: K/V rows past
``seqlens_k[b]`` may hold NaN, which ``dP^T`` would carry into dK rows that must be 0.

With DQ_ATOMIC the same kernel is the five-product backward (``triton_atomic`` on Hopper): it also adds each Q
tile's share of dQ into a float32 buffer, in a fixed order with DQ_ORDERED (see the kernel's docstring).  Its
warp-specialised block at D = 128 splits dQ's columns between the warpgroups, as FlashAttention-3 does: each
publishes its keys' dS^T in shared memory and multiplies the whole tile by its 64 columns of K
(``_exchange_ds_add_dq``), so that a warpgroup holds a 64 x 64 dQ accumulator beside dK and dV, not 64 x 128; ptxas
fits it in the 240 and 248 registers that ``setmaxnreg`` gives (4-12 B of spills, where the block of two warpgroups
in step, at 255 registers, spilled 116-120 B).  On the H100 it ran the backward at 0.89-0.94x cuDNN's at D = 128 on
the grid, where that block ran 0.61-0.70x, and at 0.91-1.03x in later A/B processes once the dQ staging tile's rows
were permuted against a bank conflict (``_staging_rows``). At D = 64 each warpgroup adds its own keys' share of all 64
columns (the same accumulator size, no exchange): 1.02-1.17x the one-warpgroup block (docs/design.md). Two dQ writer
warps, one per warpgroup, can take the reductions off the warpgroups, and with DQ_ORDERED the lock turns
(``_dq_writer``, ``dq_writer``).

Packed batches (VARLEN, ``attention_varlen``) run on ``[1, H, total, D]`` views, one K/V block of one sequence per
program.  A Q/dO box of a sequence's last Q tile reaches into the next sequence's rows: those rows are zeroed in
shared memory before the tile's products (``zero_rows_from``; lse2 = +inf already makes P^T 0 there, but 0 * NaN is
not).  K/V rows past the sequence need nothing (a dK/dV row depends on its own key only), and a block that the
sequence's end cuts leaves by masked stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import compiled_launch
from .common import LOG2E, kv_block_opening, q_loop_bounds, softcap_tanh_scale, tanh_approx
from .forward_gluon import KERNEL_WARPS
from .gluon_hopper import (
    accumulator_layout,
    cta_barrier,
    dq_stage_slots,
    fence_async_shared,
    gl,
    gluon,
    grid_slots,
    mbarrier,
    packed_views,
    ring_wait,
    split_accumulator_layout,
    store_rows_below,
    tile_descriptor,
    tma,
    tma_load,
    tma_reduce_add,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
    zero_rows_from,
)

if TYPE_CHECKING:
    from .launch import ScoreModifiers

if gluon is not None:

    @gluon.jit
    def _tile_of(index, lo, tiles_per_head, BLOCK_M: gl.constexpr, DESCENDING: gl.constexpr):
        """Iteration ``index`` of the loop over the group's query heads and the Q tiles ``[lo, hi)`` of each ->
        ``(g, start_m)``: head ``first_head + g``, its tile at row ``start_m``; the tiles in descending order with
        DESCENDING."""
        g = index // tiles_per_head
        i = index - g * tiles_per_head
        if DESCENDING:
            i = tiles_per_head - 1 - i
        return g, lo + i * BLOCK_M

    @gluon.jit
    def _load_q_do_tile(
        q_desc, do_desc, bars, q_ring, do_ring, index, n_iters, tiles_per_head, lo, batch, first_head, row_origin,
        BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, DESCENDING: gl.constexpr,
    ):  # fmt: skip
        """Start the TMA copies of the Q and dO tiles of iteration ``index`` into their ring slots, both completing
        on the slot's one mbarrier (nothing past the loop's end).

        The loop runs over the group's query heads, then over the Q tiles ``[lo, hi)`` of each: iteration ``index``
        is tile ``index % tiles_per_head`` of head ``first_head + index // tiles_per_head``.  Its box starts at row
        ``row_origin + start_m`` (a packed sequence's first row, else 0) of ``batch`` (0 for a packed batch)."""
        g, start_m = _tile_of(index, lo, tiles_per_head, BLOCK_M, DESCENDING)
        start_m += row_origin
        pred = index < n_iters
        slot = index % NUM_STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
        tma_load(q_desc, [batch, first_head + g, start_m, 0], bar, q_ring.index(slot), pred=pred)
        tma_load(do_desc, [batch, first_head + g, start_m, 0], bar, do_ring.index(slot), pred=pred)

    @gluon.jit
    def _load_row_stat(
        stat_ptr, index, stats_at, other, layout: gl.constexpr, BLOCK_M: gl.constexpr, DESCENDING: gl.constexpr
    ):  # fmt: skip
        """lse2 or Delta of the BLOCK_M rows of iteration ``index``'s Q tile (``_tile_of``), in ``layout``; ``other``
        for rows past the sequence and an index past the loop's end (lse2: +inf, which gives P = 0; Delta: 0).
        ``stats_at = (n_iters, lo, tiles_per_head, first_stats_row, seqlen_q, stats_base, seq_q)``: statistics are
        dense ``[B, H, Nq]`` (``first_stats_row``: ``batch * H`` + the group's first head) or packed ``[H, total_q]``
        from row ``stats_base``."""
        n_iters, lo, tiles_per_head, first_stats_row, seqlen_q, stats_base, seq_q = stats_at
        g, start_m = _tile_of(index, lo, tiles_per_head, BLOCK_M, DESCENDING)
        rows = start_m + gl.arange(0, BLOCK_M, layout)
        stats = (first_stats_row + g).to(gl.int64) * seqlen_q + stats_base + rows
        return gl.load(stat_ptr + stats, mask=(rows < seq_q) & (index < n_iters), other=other)

    @gluon.jit
    def kv_block_of(
        pid, num_n_blocks, num_kv_heads, seqlen_q, seqlen_k, sequences, BLOCK_N: gl.constexpr, VARLEN: gl.constexpr
    ):  # fmt: skip
        """The block of keys of a K/V-stationary program ``pid`` (the dK/dV kernels' grid) -> ``(batch, kv_head,
        start_n, q_origin, k_origin, seq_q, seq_k, slopes_row)``.  Dense: ``num_n_blocks`` blocks per (batch, K/V
        head), origins 0, the call's lengths.  VARLEN (``sequences = (cu_seqlens_q, cu_seqlens_k, B,
        search_steps)``): ``common.kv_block_opening``'s slot of a packed batch; rows and keys count within the
        sequence, whose TMA boxes start at ``[0, head, origin + row, 0]`` (``batch`` 0), ALiBi's slopes are read at
        the sequence's row, and ``start_n >= seq_k`` marks an idle slot (the caller returns)."""
        if VARLEN:
            # (cu_seqlens_q stands in for seqlens_k, which the scope excludes)
            sequence, kv_head, start_n, q_origin, k_origin, seq_q, seq_k, _ = kv_block_opening(
                pid, num_n_blocks, num_kv_heads, sequences[0], seqlen_q, seqlen_k, sequences, BLOCK_N, False, True
            )  # fmt: skip
            batch = 0
            slopes_row = sequence
        else:
            bh_kv = pid // num_n_blocks
            batch = bh_kv // num_kv_heads
            kv_head = bh_kv % num_kv_heads
            start_n = (pid % num_n_blocks) * BLOCK_N
            q_origin = 0
            k_origin = 0
            seq_q = seqlen_q
            seq_k = seqlen_k
            slopes_row = batch
        return batch, kv_head, start_n, q_origin, k_origin, seq_q, seq_k, slopes_row

    @gluon.jit
    def _visible_t(keys, rows, diagonal_offset, window_left, window_right,
                   CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):  # fmt: skip
        """Whether key ``keys[n]`` is visible to row ``rows[m]``, as a ``[BLOCK_N, BLOCK_M]`` tile: the transposed
        ``common.key_visible`` without its ``Nk`` test (a key past Nk has a dK/dV row that the store drops; the
        five-product build masks those keys itself).  At
        least one flag is set."""
        positions = rows[None, :] + diagonal_offset  # each row's position among the keys
        if CAUSAL:
            visible = keys[:, None] <= positions
            if WINDOW_RIGHT:
                visible = visible & (keys[:, None] <= positions + window_right)
        elif WINDOW_RIGHT:
            visible = keys[:, None] <= positions + window_right
        if WINDOW_LEFT:
            if CAUSAL or WINDOW_RIGHT:
                visible = visible & (keys[:, None] >= positions - window_left)
            else:
                visible = keys[:, None] >= positions - window_left
        return visible

    @gluon.jit
    def _mask_cut_tile_t(p_t, start_m, unmasked_lo, unmasked_hi, keys, rows, diagonal_offset, window_left,
                         window_right, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                         WINDOW_RIGHT: gl.constexpr):  # fmt: skip
        """``P^T`` of the Q tile at row ``start_m`` with its hidden keys zeroed where the tile is cut: below
        ``unmasked_lo`` (the diagonal or the window's right edge) or, with WINDOW_LEFT, from ``unmasked_hi`` on (its
        left edge; ``q_loop_bounds``).  Whole tiles pass unchanged.  At least one flag is set."""
        if WINDOW_LEFT:
            cut = (start_m < unmasked_lo) | (start_m >= unmasked_hi)
        else:
            cut = start_m < unmasked_lo
        if cut:
            visible = _visible_t(
                keys, rows, diagonal_offset, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT
            )  # fmt: skip
            p_t = gl.where(visible, p_t, 0.0)
        return p_t

    @gluon.jit
    def _modified_scores_t(
        s_t, lse2, qk_scale, keys, rows, start_n, diagonal_offset, cap_in, cap_out, slope_at, CAUSAL: gl.constexpr,
        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    ):  # fmt: skip
        """The base-2 scores of a raw ``S^T`` tile ``[keys, rows]`` with the soft cap and ALiBi applied, and the
        ``lse2`` of its rows that P is taken from: ``P^T = exp2(s2 - lse2)`` -> ``(s2, lse2, tanh)``.

        SOFTCAP: ``c tanh(s / c)`` (in base 2; ``common.softcap_scores``' math), ``tanh`` returned for the cap's
        derivative ``1 - tanh^2`` in dS (unread otherwise).  ALIBI: ``-slope |i' - j|``, the slope read at
        ``slope_at = (alibi_ptr, slopes_row, head, stride_b, stride_h)`` (``slopes_row``: the batch, or a packed
        batch's sequence); with CAUSAL split as ``slope (j - start_n) - slope (i' - start_n)``: the keys' term is one
        add per score, and the rows' term, constant down a column of S^T, joins lse2 (16 values a thread where
        ``|i' - j|`` took a subtraction, a conversion and a multiply-add for each of 32 scores).  Both terms are
        small where P is not negligible: keys near ``start_n``, rows near them.  (Keys right of the diagonal get a
        wrong score; the caller's mask hides them.)"""
        if SOFTCAP:
            tanh = tanh_approx(s_t * softcap_tanh_scale(qk_scale, cap_in))  # tanh(s / c)
            s2 = cap_out * tanh
        else:
            s2 = s_t * qk_scale
            tanh = s2  # unread
        if ALIBI:
            alibi_ptr, slopes_row, head, stride_alibi_b, stride_alibi_h = slope_at
            slope2 = 1.4426950408889634 * gl.load(
                alibi_ptr + slopes_row.to(gl.int64) * stride_alibi_b + head * stride_alibi_h
            )  # fmt: skip
            if CAUSAL:
                s2 = s2 + (slope2 * (keys - start_n).to(gl.float32))[:, None]
                lse2 = lse2 + slope2 * (rows + diagonal_offset - start_n).to(gl.float32)
            else:
                s2 = s2 + _alibi_bias_t(keys, rows + diagonal_offset, slope2)
        return s2, lse2, tanh

    @gluon.jit
    def _alibi_bias_t(keys, positions, slope2):
        """ALiBi's term ``-slope |i' - j|`` in base 2 (``slope2``) as a ``[BLOCK_N, BLOCK_M]`` tile (keys along the
        rows, rows' positions ``i'`` along the columns), from the exact integer distance: keys and positions may be
        10^4 apart, and a difference of two such float32 products would lose the small distances' digits.  (With a
        causal mask the kernel splits the term instead.)"""
        return -slope2 * gl.abs(keys[:, None] - positions[None, :]).to(gl.float32)

    @gluon.jit
    def _add_dq_share(
        dq_desc, dq_first_smem, dq_second_smem, dq_locks_ptr, start_m, batch, head, num_heads, num_m_tiles, n_block,
        after_predecessor, DQ_PARTS: gl.constexpr, DQ_WIDTH: gl.constexpr, DQ_ORDERED: gl.constexpr,
    ):  # fmt: skip
        """Add this K/V block's share of the dQ of the Q tile at ``start_m`` of ``head``, staged in shared memory
        (DQ_PARTS column parts of DQ_WIDTH: ``dq_first_smem``, then ``dq_second_smem``), into the float32
        ``[B, H, padded_q, D]`` accumulator by TMA reductions (``cp.reduce.async.bulk.tensor ... .add.f32``): the
        additions take no registers nor instructions of the threads that compute, and run while the next tile's
        products do.  A 128-byte-swizzled float32 box is at most 32 columns wide, so Triton splits a part into
        32-column messages, issued by elected lanes of more than one warp; the staging tiles are rewritten only
        after every thread's ``tma.store_wait`` (each issuer waits for its own).

        DQ_ORDERED: when the block before this one also adds into the tile (``after_predecessor``), wait until the
        tile's lock shows ``n_block``; add; wait until the reductions are performed (``cp.async.bulk.wait_group 0``,
        not only read: run by every thread, since more than one issued), fence, and set the lock to
        ``n_block + 1``."""
        BLOCK_M: gl.constexpr = dq_desc.block_type.shape[2]
        lock = _dq_lock(dq_locks_ptr, batch, head, num_heads, num_m_tiles, start_m // BLOCK_M, 0)
        if DQ_ORDERED:
            _wait_turn(lock, n_block, after_predecessor)
        tma_reduce_add(dq_desc, [batch, head, start_m, 0], dq_first_smem)
        if DQ_PARTS == 2:
            tma_reduce_add(dq_desc, [batch, head, start_m, DQ_WIDTH], dq_second_smem)
        if DQ_ORDERED:
            _pass_turn(lock, n_block)

    @gluon.jit
    def _dq_lock(dq_locks_ptr, batch, head, num_heads, num_m_tiles, m_tile, part):
        """The int32 lock of column part ``part`` (0, or a warp-specialised block's warpgroup) of the dQ of Q tile
        ``m_tile`` of ``(batch, head)``: ``dq_locks`` is ``[B, H, num_m_tiles, 2]``."""
        return dq_locks_ptr + ((batch * num_heads + head).to(gl.int64) * num_m_tiles + m_tile) * 2 + part

    @gluon.jit
    def _staging_rows(tile, ROWS: gl.constexpr, COLS: gl.constexpr):
        """A float32 dQ staging tile as ``[ROWS, COLS]`` rows, row ``q`` of each group of 8 stored at ``2q mod 8 + q
        div 4`` (``dq_staging_order`` undoes it in the accumulator).  A 64-bit store of the wgmma accumulator covers
        rows q = 0..7, 32 bytes of each, in two half-warps of rows 0..3 and 4..7; the 128-byte swizzle XORs a row's
        16-byte chunk index with its row number, so rows q and q ^ 1 would put their bytes on the same banks (ncu: 4
        wavefronts a store against 2).  Placed at rows 0, 2, 4, 6 (and 1, 3, 5, 7) they take four different chunk
        pairs."""
        return tile.reshape([ROWS // 8, 2, 2, 2, COLS]).permute((0, 3, 1, 2, 4)).reshape([ROWS, COLS])

    @gluon.jit
    def _wait_turn(lock, turn, after_predecessor):
        """Ordered dQ additions: when the adder before this one also adds into the tile (``after_predecessor``),
        wait until ``lock`` shows ``turn`` (a block's index, or at D = 64 ``2 n_block + PART``: see
        ``_dq_writer``); then no thread of these warps starts a reduction before it did."""
        if after_predecessor:
            while gl.atomic_cas(lock, turn, turn, sem="acquire") != turn:
                pass
        cta_barrier()

    @gluon.jit
    def _pass_turn(lock, turn):
        """Ordered dQ additions: wait until these warps' reductions are performed (``cp.async.bulk.wait_group 0``,
        not only read: run by every thread, since more than one issued), fence, and set ``lock`` to ``turn + 1``."""
        gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0; fence.acq_rel.gpu; mov.b32 $0, 0;", "=r,r", [turn], gl.int32, False, 1
        )  # fmt: skip
        cta_barrier()  # every issuer's reductions are performed before the lock says so
        gl.atomic_xchg(lock, turn + 1, sem="release")

    @gluon.jit
    def _exchange_ds_add_dq(
        ds_t, in_flight, k_smem, exchange, dq_desc, t, batch, head, start_m, sm_scale,
        PART: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, DQ_WRITER: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialised five-product block's dQ share of Q tile ``t``, from this warpgroup's 64 rows of dS^T
        (``ds_t``, 16-bit), which it stores into its half of slot ``t % 2`` of ``ds_exchange``.

        At D = 128 (SPLIT_COLUMNS) the warpgroups split dQ's columns, as FlashAttention-3 does: ``scale * dS
        K[:, cols]`` over all 128 keys of the block for this warpgroup's 64 columns ``cols`` (a 64 x 64 accumulator,
        where the share of its own 64 keys over all D columns would be 64 x 128, 64 registers a thread).  It arrives
        on the slot's "ready" mbarrier; once both have, each multiplies the whole tile (its transpose is the left
        operand) with its columns of K, and arrives on the slot's "free" mbarrier when the product is done (the slot
        is rewritten two tiles later, after both arrivals).  At D = 64 each warpgroup multiplies its own keys' dS
        with its K rows, all 64 columns (the same 64 x 64 accumulator), and the warpgroups never wait for each
        other (but through their writers' lock turns in deterministic mode); the additions into L2 are those of two
        64-key blocks.

        Each stores its share, scaled, into its float32 staging tile.  DQ_WRITER: it arrives on the tile's "full"
        mbarrier, and its dQ writer warp (``_dq_writer``) adds the share into the accumulator of ``dq_desc`` and
        arrives on "empty" once the tile may be rewritten.  Else it adds the share itself by one TMA reduction, after
        waiting until its previous one has read the tile.  ``in_flight``: dV, dK and their register operands, still
        running; returned once complete."""
        ds_exchange, dq_stage, ds_ready, ds_free, dq_full, dq_empty = exchange
        KEYS: gl.constexpr = 64
        SPLIT_COLUMNS: gl.constexpr = BLOCK_D == 128
        COLS: gl.constexpr = BLOCK_D // 2 if SPLIT_COLUMNS else BLOCK_D
        STAGE_SLOTS: gl.constexpr = dq_stage.shape[0] // 2
        slot = t % 2
        use = t // 2
        ds_slot = ds_exchange.index(slot)
        if SPLIT_COLUMNS:
            mbarrier.wait(ds_free.index(slot), (use & 1) ^ 1)  # both products of tile t - 2 have read the slot
        ds_slot.slice(PART * KEYS, KEYS).store(ds_t)
        fence_async_shared()
        cta_barrier()  # every warp's rows are in, before any product (or the other warpgroup) reads them
        dq_layout: gl.constexpr = accumulator_layout(4, COLS)
        if SPLIT_COLUMNS:
            mbarrier.arrive(ds_ready.index(slot))
            mbarrier.wait(ds_ready.index(slot), use & 1)
            k_first = k_smem.index(0).reshape([KEYS, BLOCK_D]).slice(PART * COLS, COLS, dim=1)
            k_second = k_smem.index(1).reshape([KEYS, BLOCK_D]).slice(PART * COLS, COLS, dim=1)
            dq = warpgroup_mma(
                ds_slot.slice(0, KEYS).permute((1, 0)), k_first, gl.zeros([BLOCK_M, COLS], gl.float32, dq_layout),
                use_acc=False, is_async=True,
            )  # fmt: skip
            dq = warpgroup_mma(ds_slot.slice(KEYS, KEYS).permute((1, 0)), k_second, dq, is_async=True)
        else:
            dq = warpgroup_mma(
                ds_slot.slice(PART * KEYS, KEYS).permute((1, 0)), k_smem.index(PART).reshape([KEYS, BLOCK_D]),
                gl.zeros([BLOCK_M, COLS], gl.float32, dq_layout), use_acc=False, is_async=True,
            )  # fmt: skip
        dv, dk, p_op, ds_op = in_flight
        dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op, dq))
        if SPLIT_COLUMNS:
            mbarrier.arrive(ds_free.index(slot))
        # With DQ_WRITER the share goes to the dQ writer warp (_dq_writer), which issues the reduction, waits until
        # it has read the staging tile (and, DQ_ORDERED, for the lock's turn) and frees the tile, while this
        # warpgroup goes on to the next Q tile.
        stage = PART * STAGE_SLOTS + t % STAGE_SLOTS
        if DQ_WRITER:
            # The writer is done with the share STAGE_SLOTS tiles back (an mbarrier starts as if its phase "-1" had
            # completed: the first waits pass at once).
            mbarrier.wait(dq_empty.index(stage), ((t // STAGE_SLOTS) & 1) ^ 1)
        else:
            tma.store_wait(0)  # the previous tile's reduction has read the staging tile (each issuer waits for its own)
            cta_barrier()
        _staging_rows(dq_stage.index(stage), BLOCK_M, COLS).store(dq * sm_scale)
        fence_async_shared()
        cta_barrier()  # every warp's rows are in, before the one arrive (or the reduction)
        if DQ_WRITER:
            mbarrier.arrive(dq_full.index(stage))
        else:
            tma_reduce_add(dq_desc, [batch, head, start_m, PART * COLS if SPLIT_COLUMNS else 0], dq_stage.index(stage))
        return dv, dk, p_op, ds_op

    @gluon.jit
    def _dq_writer(
        dq_desc, exchange, n_iters, lo, tiles_per_head, batch, first_head, order,
        PART: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, DQ_WRITER: gl.constexpr,
        DQ_ORDERED: gl.constexpr, DESCENDING: gl.constexpr,
    ):  # fmt: skip
        """A dQ writer warp of the warp-specialised five-product block, one per warpgroup: for each Q tile, the
        warpgroup PART's share by one TMA reduction from its staging tile, which it frees once the reduction has
        read it.

        The warpgroup only stores its share and arrives (``_exchange_ds_add_dq``); waiting for the reduction's
        reads, and DQ_ORDERED for the lock's turn, are this warp's, so that they hold up no product.  DQ_ORDERED:
        ``order = (dq_locks_ptr, num_heads, num_m_tiles, n_block, prev_lo, prev_hi)``; at D = 128 each warpgroup's
        columns have a lock of their own (turn ``n_block``), at D = 64 both add into every column in turns
        ``2 n_block + PART`` of one lock (``_dq_lock``).  Without DQ_WRITER (the two-kernel backward's dK/dV block,
        and the unordered additions of a causal call or at D = 64: ``dq_writer``) it returns at once."""
        _, dq_stage, _, _, dq_full, dq_empty = exchange
        SPLIT_COLUMNS: gl.constexpr = BLOCK_D == 128
        COLS: gl.constexpr = BLOCK_D // 2 if SPLIT_COLUMNS else BLOCK_D
        STAGE_SLOTS: gl.constexpr = dq_stage.shape[0] // 2
        if DQ_WRITER:
            for t in range(n_iters):
                g, start_m = _tile_of(t, lo, tiles_per_head, BLOCK_M, DESCENDING)
                stage = PART * STAGE_SLOTS + t % STAGE_SLOTS
                mbarrier.wait(dq_full.index(stage), (t // STAGE_SLOTS) & 1)
                if DQ_ORDERED:
                    dq_locks_ptr, num_heads, num_m_tiles, n_block, prev_lo, prev_hi = order
                    after_predecessor = (start_m >= prev_lo) & (start_m < prev_hi)
                    if SPLIT_COLUMNS:  # this warpgroup's columns: a lock of their own, turn n_block
                        lock_part, turn = PART, n_block
                    else:  # every column: one lock, turns 2n (the first writer's) and 2n + 1 (after it, always)
                        lock_part, turn = 0, 2 * n_block + PART
                        after_predecessor = after_predecessor | (PART == 1)
                    lock = _dq_lock(dq_locks_ptr, batch, first_head + g, num_heads, num_m_tiles, start_m // BLOCK_M,
                                    lock_part)  # fmt: skip
                    _wait_turn(lock, turn, after_predecessor)
                tma_reduce_add(dq_desc, [batch, first_head + g, start_m, PART * COLS if SPLIT_COLUMNS else 0],
                               dq_stage.index(stage))  # fmt: skip
                if DQ_ORDERED:
                    _pass_turn(lock, turn)
                else:
                    tma.store_wait(0)  # the reduction has read the staging tile
                mbarrier.arrive(dq_empty.index(stage))
            tma.store_wait(0)

    @gluon.jit
    def _dkdv_keys(
        inputs, outputs, smem, bars, scalars, stats, stats_at, modifiers, dq_share, exchange,
        PART: gl.constexpr, NUM_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
        BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, IS_FP16: gl.constexpr,
        VARLEN: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_ORDERED: gl.constexpr, INLINE_LOADS: gl.constexpr,
        DQ_WRITER: gl.constexpr,
    ):  # fmt: skip
        """dK and dV of the KEYS keys of part PART of the K/V block, computed by NUM_WARPS warps (16 keys a warp; the
        loop of the module docstring), and their store.

        INLINE_LOADS: these warps are the whole block and refill the Q/dO ring themselves (the kernel has issued K, V
        and the first NUM_STAGES tiles); else they are one warpgroup of the warp-specialised block and release each
        slot to the producer warp (``_dkdv_load_tiles``) by an arrive on its "empty" mbarrier.
        ``scalars = (batch, kv_head, first_head, block_start, lo, unmasked_lo, unmasked_hi, n_iters, tiles_per_head,
        q_origin, k_origin, seq_q, seq_k, slopes_row, sm_scale, qk_scale)``: the part's keys start at ``block_start +
        PART * KEYS``; the Q tiles ``[lo, hi)`` and the masked stages are the whole block's, one loop for every part.
        ``inputs = (q_desc, do_desc)``; ``outputs = (dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkv_row)`` (the
        pointers address a packed batch's rows that a TMA store may not write); ``stats = (lse2_ptr, delta_ptr)``
        and ``stats_at`` as ``_load_row_stat`` takes them; ``dq_share = (dq_desc, dq_locks_ptr, num_heads,
        num_m_tiles, prev_lo, prev_hi)``, read with DQ_ATOMIC (see the kernel); ``exchange = (ds_exchange, dq_stage,
        ds_ready, ds_free, dq_full, dq_empty)``: the warp-specialised five-product block's shared dS^T slots, dQ
        staging tiles and their mbarriers (``_exchange_ds_add_dq``, ``_dq_writer``)."""
        q_desc, do_desc = inputs
        dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkv_row = outputs
        k_smem, v_smem, q_ring, do_ring, stats_smem = smem
        kv_bar, q_do_bars, q_do_empty = bars
        (batch, kv_head, first_head, block_start, lo, unmasked_lo, unmasked_hi, n_iters, tiles_per_head, q_origin,
         k_origin, seq_q, seq_k, slopes_row, sm_scale, qk_scale) = scalars  # fmt: skip
        lse2_ptr, delta_ptr = stats
        window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h = modifiers
        dq_desc, dq_locks_ptr, num_heads, num_m_tiles, prev_lo, prev_hi = dq_share
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16
        # Q tiles [lo, unmasked_lo) cross the causal diagonal (or the window's right edge) and [unmasked_hi, hi) its
        # left edge: they take the mask (a compile-time flag: without a mask no mask code is emitted at all).
        MASKED: gl.constexpr = CAUSAL or WINDOW_LEFT or WINDOW_RIGHT
        # Ordered dQ additions under a causal mask: the Q tiles from the last one down.  Every block of a head then
        # meets its predecessor on its first tile one step behind it; in ascending order block n's first tile is
        # block n-1's third (with 128 keys and 64 rows a block), and the waits add up along the blocks.
        DESCENDING: gl.constexpr = DQ_ORDERED and CAUSAL
        # Accumulator layouts: S^T and dP^T [KEYS, BLOCK_M], dK and dV [KEYS, BLOCK_D]; each warpgroup owns 64 keys.
        # P^T and dS^T go from the first layout's registers straight into the second's left operand.
        st_layout: gl.constexpr = accumulator_layout(NUM_WARPS, BLOCK_M)
        dkv_layout: gl.constexpr = accumulator_layout(NUM_WARPS, BLOCK_D)
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
        row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        stats_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])  # one value a thread
        # Statistics through shared memory (not in the five-product 64-key block, where it measured 0.95x: see the
        # loop):
        # lse2 and Delta of the current Q tile (slot t % 2) and of the next one, rows 2 * slot and 2 * slot + 1 of
        # this part's four.
        STATS_SMEM: gl.constexpr = not (DQ_ATOMIC and INLINE_LOADS)
        stats_first = 4 * PART
        start_n = block_start + PART * KEYS

        if DQ_ATOMIC and INLINE_LOADS:
            # dS^T leaves the registers for dQ = dS K, whose rows are the Q tile's (the registers hold keys along
            # the rows): the product reads it transposed from shared memory.  Its accumulator splits the D columns
            # between the warpgroups when the tile has fewer than 64 rows per warpgroup.
            ds_smem = gl.allocate_shared_memory(
                DTYPE, [KEYS, BLOCK_M], gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], DTYPE)
            )  # fmt: skip
            # dQ's share is staged in shared memory for its TMA reductions, in the column parts of the host's
            # descriptor boxes (dq_share_width: two halves at D = 128, fewer registers held at once).
            DQ_WIDTH: gl.constexpr = dq_desc.block_type.shape[3]
            DQ_PARTS: gl.constexpr = BLOCK_D // DQ_WIDTH
            gl.static_assert(dq_desc.block_type.shape[2] == BLOCK_M, "dq_desc's box: BLOCK_M rows")
            gl.static_assert(DQ_PARTS * DQ_WIDTH == BLOCK_D and DQ_PARTS <= 2, "dq_desc's box: half or all of D")
            # Two allocations, not one of two parts: a store into the second part would wait at a CTA barrier for
            # the first one's (Triton orders writes to one buffer).
            dq_first_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
            if DQ_PARTS == 2:
                dq_second_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
            else:  # not used
                dq_second_smem = dq_first_smem
            dq_layout: gl.constexpr = split_accumulator_layout(NUM_WARPS, BLOCK_M, DQ_WIDTH)
            fence_async_shared()

        if STATS_SMEM:  # tile 0's statistics into slot 0
            lse2_next = _load_row_stat(lse2_ptr, 0, stats_at, float("inf"), stats_layout, BLOCK_M, DESCENDING)
            delta_next = _load_row_stat(delta_ptr, 0, stats_at, 0.0, stats_layout, BLOCK_M, DESCENDING)
            stats_smem.index(stats_first).store(lse2_next)
            stats_smem.index(stats_first + 1).store(delta_next)
        mbarrier.wait(kv_bar, 0)
        cta_barrier()  # (slot 0 of the statistics stored by every warp)
        k_tile = k_smem.index(PART).reshape([KEYS, BLOCK_D])
        v_tile = v_smem.index(PART).reshape([KEYS, BLOCK_D])

        keys = start_n + gl.arange(0, KEYS, key_layout)
        local_rows = gl.arange(0, BLOCK_M, row_layout)
        diagonal_offset = seq_k - seq_q
        dk = gl.zeros([KEYS, BLOCK_D], gl.float32, dkv_layout)
        dv = gl.zeros([KEYS, BLOCK_D], gl.float32, dkv_layout)
        # The last tile's registers serve as the (ignored) accumulator inputs of S^T and dP^T: no zeroing per tile.
        s_t = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)
        dp_t = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)

        for t in range(n_iters):
            g, start_m = _tile_of(t, lo, tiles_per_head, BLOCK_M, DESCENDING)
            rows = start_m + local_rows
            if STATS_SMEM:
                # The next tile's lse2 and Delta: global loads now, one value a thread, whose latency the whole
                # iteration hides; into shared memory at its end.  Each thread reads its 16 columns of this tile's
                # statistics from there where the arithmetic needs them: loaded per tile in the accumulators' column
                # layout they were 32 registers a thread live beside dK, dV, S^T and dP^T, and a global load's
                # latency before each tile's exponentials (ptxas at D = 128 causal: 255 registers and 12 B of
                # spills -> 242 and none; with the soft cap 136 B -> 4 B).
                lse2_next = _load_row_stat(lse2_ptr, t + 1, stats_at, float("inf"), stats_layout, BLOCK_M, DESCENDING)
                delta_next = _load_row_stat(delta_ptr, t + 1, stats_at, 0.0, stats_layout, BLOCK_M, DESCENDING)
                stats_slot = 2 * (t % 2)
            else:
                # lse2 of this Q tile's rows, loaded before the wait so that its latency hides behind it (Delta,
                # needed later, is loaded after it: fewer registers live at once).
                lse2 = _load_row_stat(lse2_ptr, t, stats_at, float("inf"), row_layout, BLOCK_M, DESCENDING)

            q_tile = ring_wait(q_do_bars, q_ring, t, BLOCK_M, BLOCK_D, NUM_STAGES)
            do_tile = do_ring.index(t % NUM_STAGES).reshape([BLOCK_M, BLOCK_D])
            if VARLEN and INLINE_LOADS:  # noqa: SIM102 - a compile-time branch around a runtime one
                if start_m + BLOCK_M > seq_q:
                    # The box's rows past the sequence are the next sequence's: P^T and dS^T are 0 in their
                    # columns, but a non-finite Q or dO value there would make dK/dV NaN through the products.
                    # (In the warp-specialised block the producer warp zeroes them.)
                    zero_rows_from(q_tile, seq_q - start_m, NUM_WARPS)
                    zero_rows_from(do_tile, seq_q - start_m, NUM_WARPS)
                    cta_barrier()  # every warp's zeros land before any warpgroup's products read the tiles
            if DQ_ATOMIC:  # fresh (ignored) accumulator inputs: none carried across the dQ additions (16 B less spill)
                s_t = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)
                dp_t = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)
            s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_t, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), dp_t, use_acc=False, is_async=True)
            # wgmma groups complete in order: one outstanding means S^T is done and dP^T may still run.
            s_t = warpgroup_mma_wait(1, deps=(s_t,))
            if STATS_SMEM:
                lse2 = stats_smem.index(stats_first + stats_slot).load(row_layout)
            else:
                delta = _load_row_stat(delta_ptr, t, stats_at, 0.0, row_layout, BLOCK_M, DESCENDING)
            s2, lse2, tanh = _modified_scores_t(
                s_t, lse2, qk_scale, keys, rows, start_n, diagonal_offset, cap_in, cap_out,
                (alibi_ptr, slopes_row, first_head + g, stride_alibi_b, stride_alibi_h), CAUSAL, SOFTCAP, ALIBI,
            )  # fmt: skip
            p_t = gl.exp2(s2 - lse2[None, :])
            if MASKED:
                p_t = _mask_cut_tile_t(
                    p_t, start_m, unmasked_lo, unmasked_hi, keys, rows, diagonal_offset, window_left, window_right,
                    CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                )  # fmt: skip
            if DQ_ATOMIC:  # noqa: SIM102 - a compile-time branch around a runtime one
                if start_n + KEYS > seq_k:
                    # The keys past Nk (TMA's zero rows: s = 0, dP = 0) were not masked, which only dK/dV rows that
                    # the store drops saw; their dS^T = -P Delta feeds dQ here, and P = exp2(-lse2) overflows the
                    # 16-bit dS^T (inf * 0 = NaN) where a row's scores are all very negative.
                    p_t = gl.where((keys < seq_k)[:, None], p_t, 0.0)
            p_op = gl.convert_layout(p_t.to(DTYPE), operand_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
            if STATS_SMEM:
                delta = stats_smem.index(stats_first + stats_slot + 1).load(row_layout)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - tanh * tanh)
            if DQ_ATOMIC and not INLINE_LOADS:
                ds_op = gl.convert_layout(ds_t.to(DTYPE), operand_layout)
                dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
                dv, dk, p_op, ds_op = _exchange_ds_add_dq(
                    ds_t.to(DTYPE), (dv, dk, p_op, ds_op), k_smem, exchange, dq_desc, t, batch, first_head + g,
                    start_m, sm_scale, PART, BLOCK_M, BLOCK_D, DQ_WRITER,
                )  # fmt: skip
            elif DQ_ATOMIC:
                # dK and dQ both read dS^T from shared memory (fewer registers live than with dK's operand in
                # registers: 64 x 128 tiles at D = 128 fit 255 registers only so).
                ds_smem.store(ds_t.to(DTYPE))
                dv, p_op = warpgroup_mma_wait(0, deps=(dv, p_op))
                tma.store_wait(0)  # the previous tile's reductions have read the staging tiles
                fence_async_shared()
                cta_barrier()  # dQ's reduction runs over all KEYS keys: every warpgroup's dS^T rows land first
                dk = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)
                dq_first = warpgroup_mma(
                    ds_smem.permute((1, 0)), k_tile.slice(0, DQ_WIDTH, dim=1),
                    gl.zeros([BLOCK_M, DQ_WIDTH], gl.float32, dq_layout), use_acc=False, is_async=True,
                )  # fmt: skip
                if DQ_PARTS == 2:  # both halves issued behind dK: the first one's store runs under the second's product
                    dq_second = warpgroup_mma(
                        ds_smem.permute((1, 0)), k_tile.slice(DQ_WIDTH, DQ_WIDTH, dim=1),
                        gl.zeros([BLOCK_M, DQ_WIDTH], gl.float32, dq_layout), use_acc=False, is_async=True,
                    )  # fmt: skip
                    dk, dq_first = warpgroup_mma_wait(1, deps=(dk, dq_first))
                    _staging_rows(dq_first_smem, BLOCK_M, DQ_WIDTH).store(dq_first * sm_scale)
                    dq_second = warpgroup_mma_wait(0, deps=(dq_second,))
                    _staging_rows(dq_second_smem, BLOCK_M, DQ_WIDTH).store(dq_second * sm_scale)
                else:
                    dk, dq_first = warpgroup_mma_wait(0, deps=(dk, dq_first))
                    _staging_rows(dq_first_smem, BLOCK_M, DQ_WIDTH).store(dq_first * sm_scale)
                fence_async_shared()  # the share's stores, before the TMA reductions read them
            else:
                ds_op = gl.convert_layout(ds_t.to(DTYPE), operand_layout)
                dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
                # P^T and dS^T stay alive (the products read them from registers) until this wait.
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
            if STATS_SMEM:  # slot (t + 1) % 2 was last read in iteration t - 1, before the previous barrier
                stats_smem.index(stats_first + 2 - stats_slot).store(lse2_next)
                stats_smem.index(stats_first + 3 - stats_slot).store(delta_next)
            # Every warp of these keys is past the products that read slot t (and has stored its statistics).
            cta_barrier()
            if DQ_ATOMIC and INLINE_LOADS:  # (and every warp's part of the dQ share is in shared memory)
                _add_dq_share(
                    dq_desc, dq_first_smem, dq_second_smem, dq_locks_ptr, start_m, batch, first_head + g, num_heads,
                    num_m_tiles, start_n // KEYS, (start_m >= prev_lo) & (start_m < prev_hi), DQ_PARTS, DQ_WIDTH,
                    DQ_ORDERED,
                )  # fmt: skip
            if INLINE_LOADS:  # refill slot t with the tile NUM_STAGES ahead
                _load_q_do_tile(
                    q_desc, do_desc, q_do_bars, q_ring, do_ring, t + NUM_STAGES, n_iters, tiles_per_head, lo,
                    batch, first_head, q_origin, BLOCK_M, NUM_STAGES, DESCENDING,
                )  # fmt: skip
            else:
                # A wgmma is one operation of the whole warpgroup: once complete in this thread, it has read its
                # shared memory for all four warps, so one arrive per warpgroup frees the slot.
                mbarrier.arrive(q_do_empty.index(t % NUM_STAGES))

        # dK and dV leave through K's and V's shared memory and two TMA stores (rows past Nk are dropped), or, for
        # keys that the end of a packed sequence cuts, masked stores of their own rows.  Keys that no query row
        # sees (lo == hi) store zeros.
        SPLIT_COLUMNS: gl.constexpr = DQ_ATOMIC and not INLINE_LOADS and BLOCK_D == 128  # (_exchange_ds_add_dq)
        if SPLIT_COLUMNS:  # noqa: SIM102 - a compile-time branch around a runtime one
            if n_iters > 0:
                # The other warpgroup's last dQ product reads this warpgroup's K rows (its columns of them): both
                # have arrived on the last tile's "free" mbarrier once their products are done.
                last = n_iters - 1
                ds_free = exchange[3]
                mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
        k_part = k_smem.index(PART)
        v_part = v_smem.index(PART)
        dk_tile = k_part.reshape([KEYS, BLOCK_D])
        dv_tile = v_part.reshape([KEYS, BLOCK_D])
        dk_tile.store((dk * sm_scale).to(DTYPE))
        dv_tile.store(dv.to(DTYPE))
        fence_async_shared()
        cta_barrier()
        if VARLEN:  # (compile-time, as the forward's O store: no masked stores in dense builds)
            if start_n + KEYS > seq_k:
                row = (k_origin + start_n).to(gl.int64) * stride_dkv_row + kv_head * BLOCK_D
                store_rows_below(dk_tile, dk_ptr + row, stride_dkv_row, seq_k - start_n, NUM_WARPS)
                store_rows_below(dv_tile, dv_ptr + row, stride_dkv_row, seq_k - start_n, NUM_WARPS)
            else:
                tma_store(dk_desc, [batch, kv_head, k_origin + start_n, 0], k_part)
                tma_store(dv_desc, [batch, kv_head, k_origin + start_n, 0], v_part)
        else:
            tma_store(dk_desc, [batch, kv_head, start_n, 0], k_part)
            tma_store(dv_desc, [batch, kv_head, start_n, 0], v_part)
        tma.store_wait(0)

    @gluon.jit
    def _dkdv_load_tiles(
        q_desc, do_desc, k_desc, v_desc, smem, bars, q_tail, batch, kv_head, key_row, first_head, q_origin, lo,
        tiles_per_head, n_iters, seq_q, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr,
        DESCENDING: gl.constexpr,
    ):  # fmt: skip
        """The producer warp of the warp-specialised block: K and V of both warpgroups' keys (two boxes of 64 rows
        each, from TMA row ``key_row``), then Q and dO tile ``i`` of the loop (``_tile_of``) into their slots as soon
        as both warpgroups have released the slots' previous tiles.  VARLEN: a tile that reaches past the sequence's
        last row (at most the last tile of each query head) lands on ``q_tail`` instead; this warp zeroes its rows
        past the sequence and only then completes the slot's barrier (a plain arrive)."""
        k_smem, v_smem, q_ring, do_ring, _ = smem
        kv_bar, q_do_bars, q_do_empty = bars
        KEYS: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_D: gl.constexpr = k_desc.block_type.shape[3]
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for part in gl.static_range(2):
            tma_load(k_desc, [batch, kv_head, key_row + part * KEYS, 0], kv_bar, k_smem.index(part))
            tma_load(v_desc, [batch, kv_head, key_row + part * KEYS, 0], kv_bar, v_smem.index(part))
        for i in range(n_iters):
            slot = i % NUM_STAGES
            # An mbarrier starts as if its phase "-1" had completed, so the waits of the first round pass at once.
            mbarrier.wait(q_do_empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
            g, start_m = _tile_of(i, lo, tiles_per_head, BLOCK_M, DESCENDING)
            if VARLEN and start_m + BLOCK_M > seq_q:
                tail = q_tail.index(0)
                mbarrier.expect(tail, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma_load(q_desc, [batch, first_head + g, q_origin + start_m, 0], tail, q_ring.index(slot))
                tma_load(do_desc, [batch, first_head + g, q_origin + start_m, 0], tail, do_ring.index(slot))
                mbarrier.wait(tail, g & 1)  # the g-th use of q_tail: one per query head, its last tile
                zero_rows_from(q_ring.index(slot).reshape([BLOCK_M, BLOCK_D]), seq_q - start_m, 1)
                zero_rows_from(do_ring.index(slot).reshape([BLOCK_M, BLOCK_D]), seq_q - start_m, 1)
                mbarrier.arrive(q_do_bars.index(slot))
            else:
                _load_q_do_tile(
                    q_desc, do_desc, q_do_bars, q_ring, do_ring, i, n_iters, tiles_per_head, lo, batch, first_head,
                    q_origin, BLOCK_M, NUM_STAGES, DESCENDING,
                )  # fmt: skip

    @gluon.jit(do_not_specialize=[
        "num_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "num_n_blocks", "num_sequences",
        "search_steps", "window_left", "window_right", "num_m_tiles", "stride_alibi_b", "stride_alibi_h",
    ])  # fmt: skip
    def attention_dkdv_hopper_kernel(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
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
        stride_dkv_row,
        cu_seqlens_q,
        cu_seqlens_k,
        num_sequences,
        search_steps,
        dq_desc,
        dq_locks_ptr,
        num_m_tiles,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_D: gl.constexpr,
        CAUSAL: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        IS_FP16: gl.constexpr,
        VARLEN: gl.constexpr,
        WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr,
        SOFTCAP: gl.constexpr,
        ALIBI: gl.constexpr,
        DQ_ATOMIC: gl.constexpr,
        DQ_ORDERED: gl.constexpr,
        WARP_SPECIALIZED: gl.constexpr,
        DQ_WRITER: gl.constexpr,
        DQ_STAGE_SLOTS: gl.constexpr,
    ):
        """dK, dV of one block of BLOCK_N keys of one (batch, kv head); grid: 1-d, num_n_blocks * B * Hkv programs
        (as ``backward_2kernel.dkdv_kernel``), summed over the ``group_size`` query heads that read the kv head.

        One warpgroup (4 warps of 16 keys) per 64 keys of the block.  Without WARP_SPECIALIZED the launch's warps
        are the block (BLOCK_N = 16 * num_warps), run one loop in step and refill the Q/dO ring themselves after a
        barrier of all of them.  WARP_SPECIALIZED (BLOCK_N = 128, launched with 4 warps): the block is two
        warpgroups of 64 keys each, a producer warp (``gl.warp_specialize``) that loads K, V and every Q/dO tile,
        and (DQ_WRITER) two dQ writer warps; both warpgroups read each tile, a slot is refilled once both have
        released it, and (but for the five-product build's exchange of dS^T at each tile at D = 128, and its lock
        turns in deterministic mode) nothing else ties them together, so that one's arithmetic runs under the
        other's products while the block reads Q and dO once per 128 keys (half the L2 traffic of two 64-key
        blocks).  k/v/dk/dv boxes hold one warpgroup's 64 rows there.

        VARLEN (a packed batch): the descriptors are over ``[1, H, total, D]`` views of the packed tensors,
        ``seqlen_q``/``seqlen_k`` are the totals, the grid is ``num_n_blocks = total_k // BLOCK_N + B`` slots per kv
        head (``common.kv_block_opening``; idle slots return at once), lse2/Delta are ``[H, total_q]``, and
        ``dk_ptr``/``dv_ptr`` with ``stride_dkv_row`` address the packed dK/dV for the rows a TMA store may not
        write.  Dense calls do not read these arguments.

        WINDOW_LEFT/WINDOW_RIGHT: the sliding window's bounds (``ScoreModifiers``: ``window_left``/``window_right``,
        read only under their flags); the loop runs over the Q tiles that see some key of the block, and the tiles
        that the window's edges or the causal diagonal cut take the mask (``_visible_t``).  SOFTCAP: scores become
        ``c tanh(s / c)`` (base 2: ``cap_out * tanh(s * scale / c)``, ``ScoreModifiers``; always ``tanh.approx.f32``,
        the form the Triton kernels use for the 16-bit dtypes, the only ones in scope) and dS takes the factor
        ``1 - tanh^2``.  ALIBI: the slopes
        ``alibi_ptr`` float32 ``[B, H]`` (strides given; a packed batch's rows are its sequences) add
        ``-slope |i' - j|`` to each score before the exponential (``_alibi_bias_t``; with CAUSAL split into a keys'
        term and a rows' term, see the loop); the gradients' formulas are unchanged (the term does not depend on q or
        k).

        DQ_ATOMIC (the five-product backward, ``triton_atomic``'s Hopper path): each iteration also computes the Q
        tile's share ``sm_scale * dS_t K`` of dQ from this block's keys and adds it by TMA reductions
        (``_add_dq_share``; warp-specialised, ``_exchange_ds_add_dq``) into the tensor of ``dq_desc``, float32
        ``[B, H, num_m_tiles * BLOCK_M, D]`` zeroed before the launch, whose boxes are the share's column parts
        (``dq_share_width``).  DQ_ORDERED adds the shares in a fixed order (deterministic dQ): ``dq_locks_ptr``
        holds two int32 per (batch, head, Q tile), one per warpgroup of a warp-specialised block at D = 128 (the
        first only otherwise), zeroed, which the block ``n`` that adds sets to ``n + 1`` (at D = 64 the warpgroups of
        a warp-specialised block take turns ``2n`` and ``2n + 1`` on the first); a block whose predecessor also
        visits the tile first waits for that value (in the warp-specialised block its dQ writer warps wait).  The
        K/V blocks that visit a Q tile are consecutive (both ends of ``q_loop_bounds`` grow with ``start_n``), and a
        program's predecessor starts no later than it, so every wait ends.  DQ_WRITER (``dq_writer``): the
        warp-specialised block's warpgroups hand their shares to the dQ writer warps (``_dq_writer``) through
        DQ_STAGE_SLOTS staging tiles each (``gluon_hopper.dq_stage_slots``).
        """
        NUM_WARPS: gl.constexpr = gl.num_warps()
        if WARP_SPECIALIZED:
            gl.static_assert(BLOCK_N == 128 and NUM_WARPS == 4, "warp-specialised: 128 keys, launched with 4 warps")
            gl.static_assert(not DQ_ATOMIC or dq_desc.block_type.shape[3] == 64, "dq_desc's box: 64 columns")
            # The warpgroups take no lock turns: ordered additions need the writers.
            gl.static_assert(not (DQ_ATOMIC and DQ_ORDERED) or DQ_WRITER, "ordered additions: DQ_WRITER")
        gl.static_assert(not DQ_WRITER or (WARP_SPECIALIZED and DQ_ATOMIC), "DQ_WRITER: the five-product WS block")
        if not WARP_SPECIALIZED:
            gl.static_assert(BLOCK_N == 16 * NUM_WARPS, "one warpgroup per 64 keys: BLOCK_N must be 16 * num_warps")
        NUM_PARTS: gl.constexpr = 2 if WARP_SPECIALIZED else 1
        KEYS: gl.constexpr = BLOCK_N // NUM_PARTS
        gl.static_assert(k_desc.block_type.shape[2] == KEYS, "k/v boxes: the keys of one part")
        DTYPE: gl.constexpr = gl.float16 if IS_FP16 else gl.bfloat16

        batch, kv_head, start_n, q_origin, k_origin, seq_q, seq_k, slopes_row = kv_block_of(
            gl.program_id(0), num_n_blocks, num_kv_heads, seqlen_q, seqlen_k,
            (cu_seqlens_q, cu_seqlens_k, num_sequences, search_steps), BLOCK_N, VARLEN,
        )  # fmt: skip
        if VARLEN:  # noqa: SIM102 - a compile-time branch around a runtime one
            if start_n >= seq_k:  # an idle slot of the packed grid
                return
        stats_base = q_origin
        first_head = kv_head * group_size

        # Q tiles [lo, unmasked_lo) cross the causal diagonal (or the window's right edge) and [unmasked_hi, hi)
        # its left edge: they need the mask; rows outside [lo, hi) see none of the block's keys.  The same range
        # for every head of the group.  Keys past Nk need no mask here (their dK/dV rows are dropped by the store,
        # and a row of dK or dV depends on its own key only; DQ_ATOMIC masks them), so the bounds are those
        # of a whole block: its end is passed as the key count.
        lo, unmasked_lo, unmasked_hi, hi = q_loop_bounds(
            start_n, seq_q, seq_k, start_n + BLOCK_N, window_left, window_right, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        tiles_per_head = (hi - lo) // BLOCK_M
        n_iters = tiles_per_head * group_size
        DESCENDING: gl.constexpr = DQ_ORDERED and CAUSAL  # (_dkdv_keys says why)
        if DQ_ORDERED:  # the Q tiles [prev_lo, prev_hi) also take dQ shares from the block before this one
            prev_lo, _, _, prev_hi = q_loop_bounds(
                start_n - BLOCK_N, seq_q, seq_k, start_n, window_left, window_right, CAUSAL, WINDOW_LEFT,
                WINDOW_RIGHT, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if start_n == 0:
                prev_hi = prev_lo
        else:  # not read
            prev_lo = lo
            prev_hi = lo

        k_smem = gl.allocate_shared_memory(DTYPE, [NUM_PARTS, 1, 1, KEYS, BLOCK_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(DTYPE, [NUM_PARTS, 1, 1, KEYS, BLOCK_D], v_desc.layout)
        q_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_D], q_desc.layout)
        do_ring = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_D], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_do_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        q_do_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        q_tail = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        # Each part's lse2 and Delta, two slots of both (_dkdv_keys).  (The layout is a row's, as the mbarrier
        # arrays': the rows are its views.)
        stats_smem = gl.allocate_shared_memory(
            gl.float32, [4 * NUM_PARTS, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )  # fmt: skip
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_do_bars.index(i), count=1)
            mbarrier.init(q_do_empty.index(i), count=NUM_PARTS)  # one arrive per warpgroup frees a slot
        mbarrier.init(q_tail.index(0), count=1)
        # The warp-specialised five-product block: two dS^T slots that both warpgroups read, with each slot's "ready"
        # and "free" mbarriers, and DQ_STAGE_SLOTS float32 dQ staging tiles per warpgroup, each with its "full" and
        # "empty" mbarriers between the warpgroup and its dQ writer warp (_exchange_ds_add_dq, _dq_writer).
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        STAGES_DQ: gl.constexpr = 2 * DQ_STAGE_SLOTS
        dq_full = gl.allocate_shared_memory(gl.int64, [STAGES_DQ, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [STAGES_DQ, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=NUM_PARTS)
            mbarrier.init(ds_free.index(i), count=NUM_PARTS)
        for i in gl.static_range(STAGES_DQ):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        if WARP_SPECIALIZED and DQ_ATOMIC:
            ds_exchange = gl.allocate_shared_memory(
                DTYPE, [2, BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], DTYPE)
            )  # fmt: skip
            dq_stage = gl.allocate_shared_memory(gl.float32, [STAGES_DQ, 1, 1, BLOCK_M, 64], dq_desc.layout)
        else:  # not read
            ds_exchange = q_ring
            dq_stage = q_ring
        fence_async_shared()

        inputs = (q_desc, do_desc)
        outputs = (dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkv_row)
        smem = (k_smem, v_smem, q_ring, do_ring, stats_smem)
        bars = (kv_bar, q_do_bars, q_do_empty)
        scalars = (batch, kv_head, first_head, start_n, lo, unmasked_lo, unmasked_hi, n_iters, tiles_per_head,
                   q_origin, k_origin, seq_q, seq_k, slopes_row, sm_scale, qk_scale)  # fmt: skip
        stats = (lse2_ptr, delta_ptr)
        stats_at = (n_iters, lo, tiles_per_head, batch * num_heads + first_head, seqlen_q, stats_base, seq_q)
        modifiers = (window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b, stride_alibi_h)
        dq_share = (dq_desc, dq_locks_ptr, num_heads, num_m_tiles, prev_lo, prev_hi)
        exchange = (ds_exchange, dq_stage, ds_ready, ds_free, dq_full, dq_empty)
        dq_order = (dq_locks_ptr, num_heads, num_m_tiles, start_n // BLOCK_N, prev_lo, prev_hi)
        if WARP_SPECIALIZED:
            # Constexpr arguments go to the partitions as literals (forward_gluon's note).  The second warpgroup
            # rises to 240 registers and the warpgroup of the producer and the two dQ writer warps (padded to four
            # warps) drops to 24, which leaves the default partition 248: the loop used 235-255 at a 255 cap, and
            # 230-238 so (ptxas, bench/results/ptx_dkdv_ws_triton39.log).
            gl.warp_specialize(
                [
                    (_dkdv_keys, (inputs, outputs, smem, bars, scalars, stats, stats_at, modifiers, dq_share,
                                  exchange, 0, 4, BLOCK_M, 64, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, VARLEN,
                                  WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, DQ_ATOMIC, DQ_ORDERED, False,
                                  DQ_WRITER)),
                    (_dkdv_keys, (inputs, outputs, smem, bars, scalars, stats, stats_at, modifiers, dq_share,
                                  exchange, 1, 4, BLOCK_M, 64, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, VARLEN,
                                  WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, DQ_ATOMIC, DQ_ORDERED, False,
                                  DQ_WRITER)),
                    (_dkdv_load_tiles, (q_desc, do_desc, k_desc, v_desc, smem, bars, q_tail, batch, kv_head,
                                        k_origin + start_n, first_head, q_origin, lo, tiles_per_head, n_iters, seq_q,
                                        BLOCK_M, NUM_STAGES, VARLEN, DQ_ORDERED and CAUSAL)),
                    (_dq_writer, (dq_desc, exchange, n_iters, lo, tiles_per_head, batch, first_head, dq_order,
                                  0, BLOCK_M, BLOCK_D, DQ_WRITER, DQ_ORDERED, DQ_ORDERED and CAUSAL)),
                    (_dq_writer, (dq_desc, exchange, n_iters, lo, tiles_per_head, batch, first_head, dq_order,
                                  1, BLOCK_M, BLOCK_D, DQ_WRITER, DQ_ORDERED, DQ_ORDERED and CAUSAL)),
                ],
                [4, 1, 1, 1],
                [240, 24, 24, 24],
            )  # fmt: skip
        else:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma_load(k_desc, [batch, kv_head, k_origin + start_n, 0], kv_bar, k_smem.index(0))
            tma_load(v_desc, [batch, kv_head, k_origin + start_n, 0], kv_bar, v_smem.index(0))
            for i in gl.static_range(NUM_STAGES):
                _load_q_do_tile(
                    q_desc, do_desc, q_do_bars, q_ring, do_ring, i, n_iters, tiles_per_head, lo, batch, first_head,
                    q_origin, BLOCK_M, NUM_STAGES, DESCENDING,
                )  # fmt: skip
            _dkdv_keys(inputs, outputs, smem, bars, scalars, stats, stats_at, modifiers, dq_share, exchange,
                       0, NUM_WARPS, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, NUM_STAGES, IS_FP16, VARLEN, WINDOW_LEFT,
                       WINDOW_RIGHT, SOFTCAP, ALIBI, DQ_ATOMIC, DQ_ORDERED, True, False)  # fmt: skip

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(q_do_bars.index(i))
            mbarrier.invalidate(q_do_empty.index(i))
        mbarrier.invalidate(q_tail.index(0))
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_ready.index(i))
            mbarrier.invalidate(ds_free.index(i))
        for i in gl.static_range(STAGES_DQ):
            mbarrier.invalidate(dq_full.index(i))
            mbarrier.invalidate(dq_empty.index(i))


def dq_share_width(head_dim: int) -> int:
    """The columns of one part of the five-product kernel's dQ share (its ``DQ_WIDTH``): the TMA box of ``dq_acc``.

    Measured on the H100 (fp16, N = 8k, full and causal; the backward's time against the two-kernel one's in the
    same run): at D = 128 two halves of 64 columns, both products issued behind dK, were 3-5% faster than the halves
    one after the other and 9-10% faster than the whole share (more registers live: more spills); at D = 64 the
    whole share was 5-8% faster than halves."""
    return head_dim // 2 if head_dim > 64 else head_dim


@triton.jit
def _dq_in_row_order_kernel(
    dq_acc, dq, nq, padded_rows, row_blocks, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Rows ``[start, start + BLOCK_ROWS)`` of one (batch, head) of dQ: row ``r`` read from the float32 staging
    order's row ``r - r mod 8 + (2r) mod 8 + (r mod 8) div 4`` and stored in dQ's dtype.  A flat grid of
    ``B * H * row_blocks`` programs (B * H may pass grid axis 1's limit)."""
    program = tl.program_id(0)
    head = (program // row_blocks).to(tl.int64)
    rows = (program % row_blocks).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_group = rows % 8
    staged_rows = rows - in_group + (2 * in_group) % 8 + in_group // 4
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < nq)[:, None] & (cols < HEAD_DIM)[None, :]
    staged = dq_acc + head * padded_rows * HEAD_DIM + staged_rows[:, None] * HEAD_DIM + cols[None, :]
    out = dq + head * nq * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    tl.store(out, tl.load(staged, mask=mask).to(dq.dtype.element_ty), mask=mask)


def dq_staging_order(dq_acc: torch.Tensor, nq: int, dtype: torch.dtype) -> torch.Tensor:
    """``dq_acc`` (contiguous float32 ``[B, H, Nq', D]``, ``Nq'`` a multiple of 8, rows in the order of
    ``_staging_rows``: row ``8a + q`` of dQ at ``8a + 2q mod 8 + q div 4``) -> dQ ``[B, H, nq, D]`` in ``dtype``,
    rows in order.  One pass, in the plain conversion's time (H100: 72-73 us for 16k x 2048 columns, where a permuted
    view's ``copy_`` took 105 us)."""
    B, H, padded, D = dq_acc.shape
    assert dq_acc.is_contiguous() and dq_acc.dtype == torch.float32 and padded % 8 == 0 and nq <= padded
    dq = torch.empty((B, H, nq, D), dtype=dtype, device=dq_acc.device)
    block_rows = 32
    row_blocks = triton.cdiv(nq, block_rows)
    # Both tensors are fresh and contiguous: the integers and the output dtype fix the specialisation.
    launch_key = ("dq in row order", dtype, nq, padded, row_blocks, D)
    compiled_launch.launch(
        _dq_in_row_order_kernel, (B * H * row_blocks,), launch_key,
        dq_acc, dq, nq, padded, row_blocks, D, block_rows, triton.next_power_of_2(D),
    )  # fmt: skip
    return dq


def dq_writer(head_dim: int, causal: bool, ordered: bool) -> bool:
    """Whether the warp-specialised five-product block hands its dQ shares to dQ writer warps (the kernel's
    DQ_WRITER, ``_dq_writer``) rather than adding them from the warpgroups.

    Measured on the H100 (bf16/fp16, N = 1k-16k, alternating processes,
    ``bench/results/h100_five_product_dq_writer_ab.log``): with ordered additions the writers took the
    deterministic backward from 1.79-2.01x the unordered one's time to 1.17-1.26x at D = 128 and from 1.90-2.52x to
    1.34-2.06x at D = 64 (the lock waits leave the warpgroups); unordered, 1.02-1.07x faster at D = 128 without a
    causal mask, 0.97-1.01x with it, 0.91-1.01x at D = 64 (with one or two staging tiles)."""
    return ordered or (head_dim == 128 and not causal)


def dkdv_warp_specialized(num_warps: int) -> bool:
    """Whether a dK/dV config runs the warp-specialised block (the kernel's WARP_SPECIALIZED): the two-warpgroup
    tiles (``num_warps = 8``, 128 keys), in both builds."""
    return num_warps == 8


def attention_dkdv_hopper(
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
    modifiers: ScoreModifiers,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    varlen: tuple | None = None,
    dq_acc: torch.Tensor | None = None,
    dq_locks: torch.Tensor | None = None,
    launch_key: tuple | None = None,
) -> None:
    """Write ``dk``, ``dv`` ``[B, Hkv, Nk, D]`` (contiguous, dtype of q; summed over each head group).

    ``q``, ``do`` ``[B, H, Nq, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]``, in the scope that
    ``KernelVariant.DKDV.gluon_scope`` (``launch.py``) checks; ``lse2`` (lse * log2(e), +inf on empty rows) and
    ``delta`` (rowsum(dO * O)) ``[B, H, Nq]`` float32 contiguous, as the dQ kernel writes them.

    ``varlen = (cu_seqlens_q, cu_seqlens_k, B, search_steps)``: a packed batch (``launch.PreparedCall.varlen_args``),
    q, do ``[total_q, H, D]``, k, v ``[total_k, Hkv, D]``, dk, dv ``[total_k, Hkv, D]`` (contiguous), lse2 and
    delta ``[H, total_q]``.

    ``dq_acc``: the five-product backward (dense calls): also add ``dQ`` into this float32 ``[B, H, Nq', D]``
    tensor (contiguous, zeroed; Nq' is Nq rounded up to ``block_m``, the padding rows take zeros); ``dq_locks``:
    int32 ``[B, H, Nq' / block_m, 2]`` (zeroed) to add the K/V blocks' shares in a fixed order (bitwise reproducible
    dQ), None for the unordered additions.

    ``launch_key``: the call's ``launch.PreparedCall.launch_key`` of the operands other than q, k, v and the
    launcher's fresh outputs (``compiled_launch``), or None.
    """
    dk_rows, dv_rows = dk, dv  # packed: the [total_k, Hkv, D] tensors that the masked stores address
    if dv.shape != dk.shape:  # one row stride and one head offset serve both stores: Dv = D (the scope's head dims)
        raise ValueError(f"dv {tuple(dv.shape)} must have dk's shape {tuple(dk.shape)}")
    q, k, v, do, dk, dv, sequences = packed_views((q, k, v, do, dk, dv), {"dk": dk, "dv": dv}, varlen, lse2)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if block_n != 16 * num_warps:
        raise ValueError(f"block_n={block_n} with num_warps={num_warps}: the kernel needs block_n = 16 * num_warps")
    padded = (B, H, -(-Nq // block_m) * block_m, D) if varlen is None else None
    if dq_acc is not None and (varlen is not None or not dq_acc.is_contiguous() or tuple(dq_acc.shape) != padded):
        raise ValueError(f"dq_acc must be a contiguous {padded} tensor (Nq rounded up to block_m) of a dense call")
    if dq_locks is not None and (dq_acc is None or tuple(dq_locks.shape) != (*padded[:2], padded[2] // block_m, 2)):
        raise ValueError(f"dq_locks must be an int32 [B, H, Nq / block_m, 2] tensor beside dq_acc {padded}")
    num_n_blocks = grid_slots(Nk, block_n, varlen)
    q_desc = tile_descriptor(q, block_m)
    dq_desc = q_desc if dq_acc is None else tile_descriptor(dq_acc, block_m, dq_share_width(D))  # (q's: not read)
    warp_specialized = dkdv_warp_specialized(num_warps)
    writer = warp_specialized and dq_acc is not None and dq_writer(D, causal, dq_locks is not None)
    keys = 64 if warp_specialized else block_n  # the k/v/dk/dv boxes: one warpgroup's keys when specialised
    compiled_launch.launch(
        attention_dkdv_hopper_kernel, (num_n_blocks * B * Hkv,), launch_key,
        q_desc, tile_descriptor(k, keys), tile_descriptor(v, keys),
        tile_descriptor(do, block_m), tile_descriptor(dk, keys), tile_descriptor(dv, keys), lse2, delta,
        H, Hkv, H // Hkv, Nq, Nk, num_n_blocks, scale, scale * LOG2E, *modifiers.args[1:8],
        dk_rows, dv_rows, dk_rows.stride(0), *sequences, dq_desc,
        lse2 if dq_locks is None else dq_locks, -(-Nq // block_m),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=D, CAUSAL=causal, NUM_STAGES=num_stages,
        IS_FP16=q.dtype == torch.float16, VARLEN=varlen is not None, WINDOW_LEFT=modifiers.flags["WINDOW_LEFT"],
        WINDOW_RIGHT=modifiers.flags["WINDOW_RIGHT"],
        SOFTCAP=modifiers.flags["SOFTCAP"] != 0, ALIBI=modifiers.flags["ALIBI"], DQ_ATOMIC=dq_acc is not None,
        DQ_ORDERED=dq_locks is not None, WARP_SPECIALIZED=warp_specialized, DQ_WRITER=writer,
        DQ_STAGE_SLOTS=dq_stage_slots(D, writer),
        num_warps=KERNEL_WARPS if warp_specialized else num_warps,
    )  # fmt: skip
