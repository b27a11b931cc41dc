"""Which local attention calls one ring step needs: the chunk pairs of (this rank's queries, the K/V block in hand),
each a windowed problem of its own, fully masked pairs skipped and neighbours fused into one call where one window
expresses them.

SPEC.md's masks (causal, ``window``) all say: query ``p`` sees key ``t`` iff ``lo <= t - p <= hi`` (global positions),
with ``lo = (Nk - Nq) - left`` and ``hi = (Nk - Nq) + right`` (``min(hi, Nk - Nq)`` when causal), a *band* of
diagonals.  A block of the score matrix (rows from global ``qs``, keys from global ``ks``) sees the same band shifted
by ``ks - qs`` in its own coordinates ``d = j - i``, which is again a window for the local call.  Every diagonal of a
``cq x ck`` block (``-(cq - 1) <= d <= ck - 1``) holds at least one element, so two bands select the same elements of a
block iff they agree once clamped to that range: that is how a fused call over several blocks is checked exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .layout import chunks_of

INF = math.inf


@dataclass(frozen=True)
class Piece:
    """A run of rows (or keys) held locally: global position ``start``, ``size`` rows, at ``offset`` in dim 2."""

    start: int
    size: int
    offset: int


def pieces(rank: int, world: int, layout: str, local_len: int) -> tuple[Piece, ...]:
    """The pieces of rank ``rank``'s local sequence of ``local_len`` rows."""
    chunks = chunks_of(rank, world, layout)
    size = local_len // len(chunks)
    return tuple(Piece(chunk * size, size, i * size) for i, chunk in enumerate(chunks))


@dataclass(frozen=True)
class Band:
    """Key ``t`` visible from query ``p`` iff ``lo <= t - p <= hi`` (``-inf``/``inf``: unbounded)."""

    lo: float
    hi: float


def global_band(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int | None, int | None] | None) -> Band:
    """SPEC.md's causal and window masks of the whole ``Nq x Nk`` problem as one band of diagonals."""
    shift = seqlen_k - seqlen_q  # i' = i + (Nk - Nq): both masks are relative to the bottom-right diagonal
    left, right = (None, None) if window is None else window
    lo = -INF if left is None else shift - left
    hi = INF if right is None else shift + right
    if causal:
        hi = min(hi, shift)
    return Band(lo, hi)


def _clamped(lo: float, hi: float, rows: int, keys: int) -> tuple[float, float] | None:
    """The band ``[lo, hi]`` of ``d = j - i`` clamped to a ``rows x keys`` block; None when it selects nothing."""
    lo, hi = max(lo, -(rows - 1)), min(hi, keys - 1)
    return None if lo > hi else (lo, hi)


@dataclass(frozen=True)
class Launch:
    """One local attention call: query rows ``rows`` and key rows ``keys`` (``(start, stop)`` in dim 2 of the local
    tensors) with ``causal`` and ``window`` in that call's own coordinates (SPEC.md's semantics)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool
    window: tuple[int | None, int | None] | None

    @property
    def area(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.keys[1] - self.keys[0])


def _fuse(band: Band, qp: tuple[Piece, ...], kp: tuple[Piece, ...]) -> Launch | None:
    """One call over the rectangle of adjacent pieces ``qp x kp`` that computes exactly ``band`` on each of its blocks,
    or None when no single window does.  The candidate bands are the blocks' own bands moved to the rectangle's
    coordinates, and no bound."""
    q0, k0 = qp[0].offset, kp[0].offset
    rows, keys = sum(p.size for p in qp), sum(p.size for p in kp)
    blocks = []
    for a in qp:
        for b in kp:
            shift = (b.offset - k0) - (a.offset - q0)  # d in the rectangle = d in the block + shift
            move = b.start - a.start  # global t - p = d in the block + move
            blocks.append((a.size, b.size, shift, _clamped(band.lo - move, band.hi - move, a.size, b.size)))
    los = [-INF, *sorted({lo_hi[0] + shift for _, _, shift, lo_hi in blocks if lo_hi is not None})]
    his = [INF, *sorted({lo_hi[1] + shift for _, _, shift, lo_hi in blocks if lo_hi is not None})]
    for lo in los:
        for hi in his:
            if all(_clamped(lo - s, hi - s, m, n) == want for m, n, s, want in blocks):
                return _launch(lo, hi, (q0, q0 + rows), (k0, k0 + keys))
    return None


def _launch(lo: float, hi: float, rows: tuple[int, int], keys: tuple[int, int]) -> Launch:
    """The call computing band ``[lo, hi]`` (in its own ``d = j - i``) on a block: bounds that cut nothing dropped,
    the bottom-right causal band as ``causal=True``, any other as a window (``i' - left <= j <= i' + right``)."""
    m, n = rows[1] - rows[0], keys[1] - keys[0]
    lo = -INF if lo <= -(m - 1) else lo
    hi = INF if hi >= n - 1 else hi
    aligned = n - m  # the window's i' = i + (n - m)
    if lo == -INF and hi == aligned:
        return Launch(rows, keys, True, None)
    left = None if lo == -INF else int(aligned - lo)
    right = None if hi == INF else int(hi - aligned)
    return Launch(rows, keys, False, None if left is None and right is None else (left, right))


def plan_step(band: Band, query_pieces: tuple[Piece, ...], key_pieces: tuple[Piece, ...]) -> tuple[Launch, ...]:
    """The fewest calls (then the least launched area) that cover every visible element of this rank's queries
    against the key block in hand exactly once, tried as: one call over everything; one call per query piece (its
    visible key pieces fused); one per key piece.  Blocks with no visible element are never launched."""
    visible = {
        (a, b)
        for a, qp in enumerate(query_pieces)
        for b, kp in enumerate(key_pieces)
        if _clamped(band.lo - (kp.start - qp.start), band.hi - (kp.start - qp.start), qp.size, kp.size) is not None
        and qp.size * kp.size > 0
    }
    if not visible:
        return ()
    options = []
    whole = _fuse(band, query_pieces, key_pieces)
    if whole is not None:
        options.append((whole,))
    # Per query piece: the rectangles are (that piece) x (key pieces); per key piece, the transpose.
    for lines, by_rows in ((range(len(query_pieces)), True), (range(len(key_pieces)), False)):
        launches = []
        for line in lines:
            inner = sorted(b if by_rows else a for a, b in visible if (a if by_rows else b) == line)
            if not inner:
                continue
            fused = _fuse(band, *_rectangle(query_pieces, key_pieces, line, range(inner[0], inner[-1] + 1), by_rows))
            if fused is not None:
                launches.append(fused)
            else:
                launches.extend(_fuse(band, *_rectangle(query_pieces, key_pieces, line, [i], by_rows)) for i in inner)
        options.append(tuple(launches))
    return min(options, key=lambda launches: (len(launches), sum(x.area for x in launches)))


def _rectangle(query_pieces, key_pieces, line: int, span, by_rows: bool) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """Query piece ``line`` x key pieces ``span`` (``by_rows``), or query pieces ``span`` x key piece ``line``."""
    if by_rows:
        return (query_pieces[line],), tuple(key_pieces[i] for i in span)
    return tuple(query_pieces[i] for i in span), (key_pieces[line],)


@lru_cache(maxsize=256)
def ring_plan(
    rank: int,
    world: int,
    layout: str,
    local_q: int,
    local_k: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> tuple[tuple[Launch, ...], ...]:
    """The calls of rank ``rank`` at each ring step ``s`` (``s = 0 .. W-1``), where it holds the K/V block of rank
    ``(rank - s) mod W``; ``local_q``/``local_k`` are the local sequence lengths."""
    band = global_band(local_q * world, local_k * world, causal, window)
    queries = pieces(rank, world, layout, local_q)
    return tuple(
        plan_step(band, queries, pieces((rank - step) % world, world, layout, local_k)) for step in range(world)
    )
