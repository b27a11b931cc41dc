"""Tile geometry shared by the blocked reference backends (NumPy and PyTorch).

The blocked backends work on a 5-d view of the heads, ``q`` as ``[B, Hkv, G, N, D]`` and ``k``/``v`` as
``[B, Hkv, 1, N, D]`` with ``G = H // Hkv``: broadcasting in the matrix products then gives grouped-query
attention without copying K/V, and summing over axis 2 gives the group's dK/dV.

Causal masking and the sliding window are one band of diagonals.  With ``i' = i + (Nk - Nq)`` (the row aligned to
the bottom-right corner), row ``i`` sees key ``j`` iff ``lo <= j - i' <= hi``: a window ``(left, right)`` gives
``lo = -left``, ``hi = right``, and causal caps ``hi`` at 0.  A tile is skipped when no ``j - i'`` of its pairs
falls in the band, or all its keys are padding.
"""

from __future__ import annotations

from typing import Any

Band = tuple[int | None, int | None]


def key_band(causal: bool, window: tuple[int | None, int | None] | None) -> Band:
    """``(lo, hi)``: row ``i`` sees key ``j`` iff ``lo <= j - i' <= hi`` (None: unbounded on that side)."""
    lo = None if window is None or window[0] is None else -window[0]
    hi = None if window is None else window[1]
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def _diagonal_span(row_start: int, row_stop: int, col_start: int, col_stop: int, seqlen_q: int, seqlen_k: int):
    """The smallest and largest ``j - i'`` over the tile's pairs (every integer in between occurs)."""
    offset = seqlen_k - seqlen_q
    return col_start - (row_stop - 1 + offset), (col_stop - 1) - (row_start + offset)


def tile_is_empty(
    row_start: int,
    row_stop: int,
    col_start: int,
    col_stop: int,
    seqlen_q: int,
    seqlen_k: int,
    band: Band,
    max_seqlen_k: int,
) -> bool:
    """Whether no row in ``[row_start, row_stop)`` sees any key in ``[col_start, col_stop)`` (skip the tile).

    ``band`` is :func:`key_band`'s; ``max_seqlen_k`` the largest key length of the batch (keys beyond it are padding
    in every batch).
    """
    if col_start >= max_seqlen_k:
        return True
    lo, hi = band
    if lo is not None and hi is not None and lo > hi:  # an empty window: no row sees any key
        return True
    nearest, farthest = _diagonal_span(row_start, row_stop, col_start, col_stop, seqlen_q, seqlen_k)
    return (hi is not None and nearest > hi) or (lo is not None and farthest < lo)


def tile_visibility(
    xp: Any,
    row_start: int,
    row_stop: int,
    col_start: int,
    col_stop: int,
    seqlen_q: int,
    seqlen_k: int,
    band: Band,
    seqlens_k: Any,
    min_seqlen_k: int,
    device: Any = None,
) -> Any:
    """Boolean mask ``[B or 1, 1, 1, rows, cols]`` of the visible (row, key) pairs of a tile, or None if all are.

    ``xp`` is ``numpy`` or ``torch``; ``band`` is :func:`key_band`'s; ``seqlens_k`` is an int64 array/tensor ``[B]``
    of the same library, or None, and ``min_seqlen_k`` its smallest value (read once by the caller); ``device`` is
    the torch device of the tile (None for NumPy).
    """
    rows = xp.arange(row_start, row_stop).reshape(1, 1, 1, -1, 1)
    cols = xp.arange(col_start, col_stop).reshape(1, 1, 1, 1, -1)
    if device is not None:
        rows, cols = rows.to(device), cols.to(device)
    diagonal = cols - (rows + (seqlen_k - seqlen_q))  # j - i'
    nearest, farthest = _diagonal_span(row_start, row_stop, col_start, col_stop, seqlen_q, seqlen_k)
    lo, hi = band
    parts = []
    if hi is not None and farthest > hi:
        parts.append(diagonal <= hi)
    if lo is not None and nearest < lo:
        parts.append(diagonal >= lo)
    if seqlens_k is not None and col_stop > min_seqlen_k:
        parts.append(cols < seqlens_k.reshape(-1, 1, 1, 1, 1))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask
