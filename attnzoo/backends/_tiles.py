"""Tile geometry shared by the blocked reference backends (NumPy and PyTorch).

The blocked backends work on a 5-d view of the heads, ``q`` as ``[B, Hkv, G, N, D]`` and ``k``/``v`` as
``[B, Hkv, 1, N, D]`` with ``G = H // Hkv``: broadcasting in the matrix products then gives grouped-query
attention without copying K/V, and summing over axis 2 gives the group's dK/dV.
"""

from __future__ import annotations

from typing import Any


def tile_is_empty(
    row_start: int,
    row_stop: int,
    col_start: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    max_seqlen_k: int,
) -> bool:
    """Whether no row in ``[row_start, row_stop)`` sees any key from ``col_start`` on (the tile can be skipped).

    Causal is bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``.
    """
    if col_start >= max_seqlen_k:
        return True
    return causal and col_start > (row_stop - 1) + (seqlen_k - seqlen_q)


def tile_visibility(
    xp: Any,
    row_start: int,
    row_stop: int,
    col_start: int,
    col_stop: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    seqlens_k: Any,
    min_seqlen_k: int,
    device: Any = None,
) -> Any:
    """Boolean mask ``[B or 1, 1, 1, rows, cols]`` of the visible (row, key) pairs of a tile, or None if all are.

    ``xp`` is ``numpy`` or ``torch``; ``seqlens_k`` is an int64 array/tensor ``[B]`` of the same library, or None,
    and ``min_seqlen_k`` its smallest value (read once by the caller); ``device`` is the torch device of the
    tile (None for NumPy).
    """
    rows = xp.arange(row_start, row_stop).reshape(1, 1, 1, -1, 1)
    cols = xp.arange(col_start, col_stop).reshape(1, 1, 1, 1, -1)
    if device is not None:
        rows, cols = rows.to(device), cols.to(device)
    mask = None
    if causal and col_stop - 1 > row_start + (seqlen_k - seqlen_q):
        mask = cols <= rows + (seqlen_k - seqlen_q)
    if seqlens_k is not None and col_stop > min_seqlen_k:
        in_range = cols < seqlens_k.reshape(-1, 1, 1, 1, 1)
        mask = in_range if mask is None else mask & in_range
    return mask
