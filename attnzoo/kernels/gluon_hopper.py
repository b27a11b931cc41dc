"""What the Gluon kernels for Hopper share: the Gluon API of the installed Triton, the TMA ring of tile slots, the
shared-memory layout of a tile, and the switch that turns Gluon off after a compilation failure.

Gluon (``triton.experimental.gluon``) is Triton's lower-level language: its Hopper API has the asynchronous
``wgmma`` with an explicit wait (``warpgroup_mma_wait(num_outstanding)``), TMA copies completing on mbarriers, and
explicit register layouts, which is what the kernels of ``forward_gluon.py`` and ``backward_gluon.py`` need to keep
the tensor cores busy while the softmax arithmetic runs.  The API is experimental and moves between releases: this
module maps the calls that Triton 3.9 (CI's) renamed from 3.6 (the device's), and a kernel that fails to compile
turns every Gluon kernel off for the process with one warning, so the Triton kernels serve every call.

Tiles are ``[1, 1, rows, D]`` boxes of 4-d descriptors over ``[B, H, N, D]`` tensors: a box that reaches past N
reads zeros and a store past N is dropped, so tails need no predicates, and a box never crosses into the next head.
"""

from __future__ import annotations

import functools
import warnings

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.runtime.jit import constexpr_function

    # Triton 3.9 renamed the TMA copies (the old names raise there) and the CTA-wide barrier; 3.6 has only the old
    # names.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
except (ImportError, AttributeError):  # pragma: no cover - no usable Gluon Hopper API: the Triton kernels serve
    # Triton before 3.4 has no Gluon.  The kernel modules still import these names (and define no kernel).
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    GluonTensorDescriptor = tma_load = tma_store = cta_barrier = tma_reduce_add = None

__all__ = [
    "HOPPER_DTYPES",
    "accumulator_layout",
    "cta_barrier",
    "dq_stage_slots",
    "fence_async_shared",
    "gl",
    "gluon",
    "gluon_unavailable_reason",
    "head_dim_parts",
    "mbarrier",
    "record_compile_failure",
    "ring_load",
    "ring_load_pair",
    "ring_wait",
    "split_accumulator_layout",
    "tile_descriptor",
    "tma",
    "tma_load",
    "tma_reduce_add",
    "tma_store",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]

HOPPER_DTYPES = (torch.float16, torch.bfloat16)


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """``head_dim`` as the widths of the column parts a Gluon tile holds it in: ``(head_dim, 0)`` for a power of two,
    else the largest power of two below it and the rest (192 -> (128, 64)), since every Gluon tile (TMA boxes and
    shared-memory buffers included) has power-of-two dims.  ValueError when the rest is not a power of two >= 16
    (one ``wgmma`` K step)."""
    first = 1 << (head_dim.bit_length() - 1)
    second = head_dim - first
    if second and (second < 16 or second & (second - 1)):
        raise ValueError(f"head dim {head_dim} is not a power of two nor one plus a power of two >= 16")
    return first, second


def dq_stage_slots(head_dim: int, writer: bool = True) -> int:
    """The warp-specialised five-product block's float32 dQ staging tiles per warpgroup (``backward_gluon``'s
    DQ_STAGE_SLOTS): with dQ writer warps (``_dq_writer``) two at D = 64, where a tile's products are short beside a
    writer's round trip (measured on unordered calls, docs/design.md), and one at D = 128 (a second, which leaves 448
    of the 232,448 bytes of shared memory an H100 CTA may hold, measured no faster); one when the warpgroups add
    their shares themselves."""
    return 2 if writer and head_dim == 64 else 1


def check_warpgroup_rows(block_m: int, num_warps: int) -> None:
    """The Q-stationary Gluon kernels (forward, dQ) run one warpgroup of 4 warps per 64 rows of a Q block:
    ValueError unless ``block_m`` is 64 or 128 and ``16 * num_warps``."""
    if block_m not in (64, 128) or block_m != 16 * num_warps:
        raise ValueError(
            f"block_m={block_m} with num_warps={num_warps}: the kernel runs one warpgroup (4 warps) per 64 rows, "
            "block_m = 64 or 128"
        )


if gluon is not None and tma_reduce_add is None:  # Triton 3.6: the builder has the op, the language no call
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into the global box at ``coord`` of ``tensor_desc`` with one TMA
        reduction (``cp.reduce.async.bulk.tensor ... .add``); completes like a TMA store (``tma.store_wait``)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


if gluon is not None:

    @constexpr_function
    def accumulator_layout(num_warps, columns, operand_bits=16):
        """The register layout of a ``wgmma`` accumulator with ``columns`` columns (the product's N): one warpgroup
        (4 warps of 16 rows) per 64 rows, so ``num_warps // 4`` warpgroups stacked along the rows.  One instruction
        reduces over 32 bytes of each operand row: K = 16 for 16-bit operands, 32 for FP8 ones."""
        k = 256 // operand_bits
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, columns, k])

    @constexpr_function
    def split_accumulator_layout(num_warps, rows, columns):
        """The register layout of a 16-bit ``wgmma`` accumulator ``[rows, columns]`` where ``rows`` may be fewer
        than 16 per warp: the warpgroups (64 rows each) stack along the rows as far as they go, and split the
        columns beyond (64 rows over 8 warps: each warpgroup takes half the columns)."""
        along_rows = min(num_warps, rows // 16)
        along_columns = num_warps // along_rows
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[along_rows, along_columns], instr_shape=[16, columns // along_columns, 16]
        )

    @gluon.jit
    def ring_load(desc, bars, ring, index, batch, head, row, pred, NUM_STAGES: gl.constexpr):
        """Start the TMA copy of the ``[1, 1, rows, D]`` box at ``(batch, head, row)`` into slot ``index %
        NUM_STAGES`` of ``ring``; its mbarrier completes when the bytes have landed.  Nothing when ``pred`` is
        false (a tile past the end of the loop)."""
        slot = index % NUM_STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma_load(desc, [batch, head, row, 0], bar, ring.index(slot), pred=pred)

    @gluon.jit
    def ring_load_pair(desc, desc2, bars, ring, ring2, index, batch, head, row, pred, NUM_STAGES: gl.constexpr):
        """``ring_load`` of a tile kept as two column parts (``desc``/``ring`` and ``desc2``/``ring2``: a head dim that
        is not a power of two, 192 = 128 + 64), both completing one mbarrier."""
        slot = index % NUM_STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, desc.block_type.nbytes + desc2.block_type.nbytes, pred=pred)
        tma_load(desc, [batch, head, row, 0], bar, ring.index(slot), pred=pred)
        tma_load(desc2, [batch, head, row, 0], bar, ring2.index(slot), pred=pred)

    @gluon.jit
    def ring_wait(bars, ring, index, ROWS: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Wait for the tile loaded as number ``index`` of the ring; returns its slot as a ``[ROWS, BLOCK_D]`` view.

        A slot's barrier completes once per use, so the phase to wait for is the use count's parity."""
        slot = index % NUM_STAGES
        mbarrier.wait(bars.index(slot), (index // NUM_STAGES) & 1)
        return ring.index(slot).reshape([ROWS, BLOCK_D])

    @gluon.jit
    def zero_rows_from(tile, first_zero, NUM_WARPS: gl.constexpr):
        """Zero the rows ``first_zero ..`` of a ``[ROWS, COLS]`` shared-memory tile with ``NUM_WARPS`` warps, a few
        rows at a time (8 for one warp, else 16; slices follow the 8-row swizzle pattern), and make the writes
        visible to the tensor cores' reads.  The unrolled chunks spill a few words in a lone producer warp (8-28 B
        stored, once per tile zeroed).

        A packed sequence's last tile of a TMA box reaches into the next sequence's rows (a box zero-fills only past
        the whole tensor).  Where such rows meet a zero factor (P = 0 for keys or rows outside the sequence), ``0 *
        inf`` and ``0 * NaN`` are still NaN: a non-finite value of the next sequence would reach this one through the
        product.  Rows whose scores are replaced by ``-inf`` need no such care."""
        ROWS: gl.constexpr = tile.type.shape[0]
        COLS: gl.constexpr = tile.type.shape[1]
        # Wider tiles go as 128-column halves: a lone producer warp (24 registers after setmaxnreg) holding a chunk
        # of 256 columns spills it (ptxas: 1.1-1.8 KB in the packed D = 256 builds), one of 128 does not.
        PART_COLS: gl.constexpr = 128 if COLS > 128 else COLS
        CHUNK: gl.constexpr = 8 if NUM_WARPS == 1 else 16
        LANE_COLS: gl.constexpr = 32 if PART_COLS // 8 > 32 else PART_COLS // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANE_COLS, LANE_COLS], [NUM_WARPS, 1], [1, 0])
        for c in gl.static_range(ROWS // CHUNK):
            for h in gl.static_range(COLS // PART_COLS):
                part = tile.slice(c * CHUNK, CHUNK)
                if COLS > PART_COLS:
                    part = part.slice(h * PART_COLS, PART_COLS, dim=1)
                values = part.load(layout)
                row = c * CHUNK + gl.arange(0, CHUNK, gl.SliceLayout(1, layout))
                part.store(gl.where(row[:, None] >= first_zero, gl.zeros_like(values), values))
        fence_async_shared()

    @gluon.jit
    def store_rows_below(tile, first_row_ptr, stride_row, rows_kept, NUM_WARPS: gl.constexpr):
        """Store the rows ``0 .. rows_kept - 1`` of a ``[ROWS, COLS]`` shared-memory tile with ``NUM_WARPS`` warps to
        global rows ``first_row_ptr + r * stride_row``, 16 rows at a time: the end of a packed sequence inside a
        slab, whose later rows belong to the next sequence (a TMA store would overwrite them)."""
        ROWS: gl.constexpr = tile.type.shape[0]
        COLS: gl.constexpr = tile.type.shape[1]
        CHUNK: gl.constexpr = 16
        LANE_COLS: gl.constexpr = 32 if COLS // 8 > 32 else COLS // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANE_COLS, LANE_COLS], [NUM_WARPS, 1], [1, 0])
        cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
        for c in gl.static_range(ROWS // CHUNK):
            row = c * CHUNK + gl.arange(0, CHUNK, gl.SliceLayout(1, layout))
            values = tile.slice(c * CHUNK, CHUNK).load(layout)
            at = first_row_ptr + row.to(gl.int64)[:, None] * stride_row + cols[None, :]
            gl.store(at, values, mask=(row < rows_kept)[:, None])

else:  # pragma: no cover - see the import above
    accumulator_layout = split_accumulator_layout = ring_load = ring_load_pair = ring_wait = None
    zero_rows_from = store_rows_below = None


_compile_failure: list[str] = []  # the first compilation error of a Gluon kernel in this process, if any


def gluon_unavailable_reason() -> str | None:
    """Why the Gluon kernels cannot run with this Triton (None when they can): no Gluon Hopper API, or a kernel
    failed to compile with it earlier in this process (the API is experimental: run on 3.6, compiled on 3.9)."""
    if gluon is None:
        return "this Triton has no usable Gluon Hopper API (triton.experimental.gluon)"
    if _compile_failure:
        return f"a Gluon kernel did not compile with this Triton: {_compile_failure[0]}"
    return None


def record_compile_failure(error: Exception) -> None:
    """Turn the Gluon kernels off for this process after a compilation error, with one warning saying why."""
    if not _compile_failure:
        _compile_failure.append(f"{type(error).__name__}: {str(error)[:500]}")
        warnings.warn(
            f"attnzoo: a Gluon Hopper kernel does not compile with this Triton; using the Triton kernels "
            f"({_compile_failure[0]})",
            RuntimeWarning,
            stacklevel=3,
        )


@functools.cache
def _tile_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a ``[1, 1, rows, cols]`` TMA box (128-byte swizzle for these tiles)."""
    gl_dtype = {
        torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
        torch.float32: gl.float32,
    }[dtype]  # fmt: skip
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gl_dtype)


def packed_views(
    tensors: tuple[torch.Tensor, ...], outputs: dict[str, torch.Tensor], varlen: tuple | None, stand_in: torch.Tensor
) -> tuple:
    """``(*tensors, sequences)`` for a launcher: for a packed batch (``varlen = (cu_seqlens_q, cu_seqlens_k, B,
    search_steps)``) each ``[total, heads, *]`` tensor seen as ``[1, heads, total, *]`` (a head's rows of the whole
    packed tensor, one TMA box per tile) once the ``outputs`` (by name) are checked contiguous, since the masked
    stores of a cut block step rows by ``heads * width``; and ``varlen`` as the kernels' sequence arguments.  For a
    dense call the tensors as they are and ``stand_in`` in the sequences' place (not read)."""
    if varlen is None:
        return (*tensors, (stand_in, stand_in, 0, 0))
    for name, x in outputs.items():
        if not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [total, heads, head_dim] tensor for a packed batch")
    return (*(x.unsqueeze(0).transpose(1, 2) for x in tensors), varlen)


def grid_slots(rows: int, block: int, varlen: tuple | None) -> int:
    """Programs per (batch, head) of a grid over ``rows`` in blocks of ``block``: ``ceil(rows / block)``; packed
    (``rows`` = total, per head), ``rows // block + B``: each sequence's blocks and at most one idle slot per
    sequence (``common.varlen_block``, ``kv_block_opening``)."""
    return -(-rows // block) if varlen is None else rows // block + varlen[2]


def tile_descriptor(x: torch.Tensor, rows: int, cols: int | None = None) -> GluonTensorDescriptor:
    """A Gluon TMA descriptor of ``x`` ``[B, H, N, D]`` whose box is ``[1, 1, rows, cols]`` (default: all D columns;
    one tile of one head)."""
    box = [1, 1, rows, x.shape[-1] if cols is None else cols]
    return GluonTensorDescriptor(x, list(x.shape), list(x.stride()), box, _tile_layout(rows, box[3], x.dtype))
