"""``numpy_ref``: the online-softmax algorithm in pure NumPy, and its explicit backward.

Forward, for each block of query rows, streams over K/V blocks and keeps per row a running max ``m``,
a running sum ``l`` of ``exp(s - m)`` and an unnormalised output ``acc``.  When a new block raises the
max from ``m`` to ``m_new``, everything gathered so far is rescaled by ``alpha = exp(m - m_new)``:

    l   <- alpha * l   + rowsum(exp(s - m_new))
    acc <- alpha * acc + exp(s - m_new) @ v_tile

At the end ``o = acc / l`` and ``lse = m + log(l)``.  No ``N x N`` array is ever formed: the largest
temporaries are ``[B, H, block_m, block_n]`` score tiles.

Backward recomputes each tile's probabilities from the saved ``lse`` (``P = exp(S - lse)``), and uses
``Delta = rowsum(dO * O)`` (equal to ``rowsum(dP * P)``) so that ``dS = P * (dP - Delta)`` needs no
second pass over K/V.
"""

from __future__ import annotations

import numpy as np
import torch

from ..backend import Backend, Capabilities, poison_outputs, register
from ..validation import Problem
from ._tiles import tile_is_empty, tile_visibility


def _to_numpy(x, dtype: np.dtype) -> np.ndarray:
    """A NumPy copy of ``x`` in ``dtype`` (bfloat16 tensors go through float32: NumPy has no bfloat16)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        return x.numpy().astype(dtype, copy=False)
    return np.asarray(x, dtype=dtype)


def _output(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An output array the loops fill completely (NaN-filled under ``ATTNZOO_POISON_OUTPUTS=1``)."""
    return np.full(shape, np.nan, dtype) if poison_outputs() else np.empty(shape, dtype)


def _like_input(x: np.ndarray, problem: Problem, template):
    """Return ``x`` in the kind (array or tensor) and dtype of the inputs."""
    if problem.is_numpy:
        return x.astype(template.dtype, copy=False)
    return torch.from_numpy(np.ascontiguousarray(x)).to(problem.dtype)


class _Geometry:
    """The 5-d grouped views and mask parameters of one call."""

    def __init__(self, problem: Problem, seqlens_k, block_m: int, block_n: int):
        p = problem
        self.p, self.block_m, self.block_n = p, block_m, block_n
        self.acc = np.float64 if p.dtype == torch.float64 else np.float32
        self.seqlens = None if seqlens_k is None else _to_numpy(seqlens_k, np.int64)
        self.min_seqlen = p.seqlen_k if self.seqlens is None else int(self.seqlens.min(initial=p.seqlen_k))
        self.max_seqlen = p.seqlen_k if self.seqlens is None else int(self.seqlens.max(initial=0))

    def q_view(self, x) -> np.ndarray:
        p = self.p
        return _to_numpy(x, self.acc).reshape(p.batch, p.kv_heads, p.group_size, p.seqlen_q, -1)

    def kv_view(self, x) -> np.ndarray:
        p = self.p
        return _to_numpy(x, self.acc).reshape(p.batch, p.kv_heads, 1, p.seqlen_k, p.head_dim)

    def tiles(self, m0: int, n0: int):
        """(skip, visibility mask or None) of the tile at rows ``m0``, keys ``n0``."""
        p = self.p
        m1, n1 = min(m0 + self.block_m, p.seqlen_q), min(n0 + self.block_n, p.seqlen_k)
        if tile_is_empty(m0, m1, n0, p.seqlen_q, p.seqlen_k, p.causal, self.max_seqlen):
            return True, None
        mask = tile_visibility(np, m0, m1, n0, n1, p.seqlen_q, p.seqlen_k, p.causal, self.seqlens, self.min_seqlen)
        return False, mask


def forward(q, k, v, problem: Problem, seqlens_k, block_m: int = 64, block_n: int = 64):
    """Online-softmax forward.  Returns ``o`` ``[B, H, Nq, D]`` and ``lse`` ``[B, H, Nq]``, NumPy arrays in the
    accumulation dtype (float64 for float64 inputs, float32 otherwise: the contract's lse dtype)."""
    geo = _Geometry(problem, seqlens_k, block_m, block_n)
    q5, k5, v5 = geo.q_view(q), geo.kv_view(k), geo.kv_view(v)
    o = _output(q5.shape, geo.acc)
    lse = _output(q5.shape[:-1], geo.acc)
    for m0 in range(0, problem.seqlen_q, block_m):
        q_tile = q5[..., m0 : m0 + block_m, :]
        m_i = np.full(q_tile.shape[:-1], -np.inf, geo.acc)
        l_i = np.zeros(q_tile.shape[:-1], geo.acc)
        acc = np.zeros(q_tile.shape, geo.acc)
        for n0 in range(0, problem.seqlen_k, block_n):
            skip, mask = geo.tiles(m0, n0)
            if skip:
                continue
            k_tile, v_tile = k5[..., n0 : n0 + block_n, :], v5[..., n0 : n0 + block_n, :]
            s = (q_tile @ k_tile.swapaxes(-1, -2)) * problem.scale
            if mask is not None:
                s = np.where(mask, s, -np.inf)
            m_new = np.maximum(m_i, s.max(axis=-1))
            # A row that has seen no key yet has m_new = -inf; shifting by 0 instead keeps
            # exp(-inf - -inf) = NaN out, and its p and alpha are then exactly 0.
            shift = np.where(np.isneginf(m_new), 0.0, m_new)
            alpha = np.exp(m_i - shift)
            p = np.exp(s - shift[..., None])
            l_i = alpha * l_i + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v_tile
            m_i = m_new
        # l = 0 exactly for a row that saw no key.  A NaN score makes l NaN, which fails the test, so the NaN
        # reaches o and lse instead of passing for a fully masked row.
        empty = l_i == 0
        o[..., m0 : m0 + block_m, :] = np.where(empty[..., None], 0.0, acc / np.where(empty, 1.0, l_i)[..., None])
        lse[..., m0 : m0 + block_m] = np.where(empty, -np.inf, m_i + np.log(np.where(empty, 1.0, l_i)))
    shape4 = (problem.batch, problem.heads, problem.seqlen_q, problem.head_dim)
    return o.reshape(shape4), lse.reshape(shape4[:-1])


def backward(do, q, k, v, o, lse, problem: Problem, seqlens_k, block_m: int = 64, block_n: int = 64):
    """Explicit backward, K/V blocks outside and Q blocks inside.  Returns NumPy ``dq, dk, dv``."""
    geo = _Geometry(problem, seqlens_k, block_m, block_n)
    q5, k5, v5 = geo.q_view(q), geo.kv_view(k), geo.kv_view(v)
    do5, o5 = geo.q_view(do), geo.q_view(o)
    lse5 = _to_numpy(lse, geo.acc).reshape(q5.shape[:-1])
    # Delta_i = sum_j P_ij dP_ij = sum_j P_ij (dO_i . V_j) = dO_i . O_i: one pass over O instead of over K/V.
    delta = (do5 * o5).sum(axis=-1)
    # Rows with no visible key have lse = -inf and P = 0; a finite stand-in keeps exp() NaN-free.
    lse_safe = np.where(np.isneginf(lse5), 0.0, lse5)
    dq = np.zeros(q5.shape, geo.acc)
    dk = _output((problem.batch, problem.kv_heads, problem.seqlen_k, problem.head_dim), geo.acc)
    dv = _output(dk.shape, geo.acc)
    for n0 in range(0, problem.seqlen_k, block_n):
        k_tile, v_tile = k5[..., n0 : n0 + block_n, :], v5[..., n0 : n0 + block_n, :]
        dk_tile = np.zeros(dk[..., n0 : n0 + block_n, :].shape, geo.acc)
        dv_tile = np.zeros_like(dk_tile)
        for m0 in range(0, problem.seqlen_q, block_m):
            skip, mask = geo.tiles(m0, n0)
            if skip:
                continue
            rows = slice(m0, m0 + block_m)
            q_tile, do_tile = q5[..., rows, :], do5[..., rows, :]
            s = (q_tile @ k_tile.swapaxes(-1, -2)) * problem.scale
            # P = exp(S - lse), exactly 0 for hidden keys and for rows with no visible key: their exponent is set
            # to -inf first (a hidden score may exceed lse, and exp of the difference would overflow).
            hidden = np.isneginf(lse5[..., rows, None])
            if mask is not None:
                hidden = hidden | ~mask
            p = np.exp(np.where(hidden, -np.inf, s - lse_safe[..., rows, None]))
            dv_tile += (p.swapaxes(-1, -2) @ do_tile).sum(axis=2)
            dp = do_tile @ v_tile.swapaxes(-1, -2)
            ds = p * (dp - delta[..., rows, None])
            dq[..., rows, :] += (ds @ k_tile) * problem.scale
            dk_tile += (ds.swapaxes(-1, -2) @ q_tile).sum(axis=2) * problem.scale
        dk[..., n0 : n0 + block_n, :] = dk_tile
        dv[..., n0 : n0 + block_n, :] = dv_tile
    return dq.reshape(problem.batch, problem.heads, problem.seqlen_q, problem.head_dim), dk, dv


@register
class NumpyRef(Backend):
    """Pure-NumPy online softmax (CPU); the most readable backend, and the only one that takes NumPy arrays."""

    name = "numpy_ref"
    capabilities = Capabilities(
        summary="pure-NumPy online-softmax forward blocked over K/V, explicit backward",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16}),
        accepts_numpy=True,
        auto_rank={"cpu": 30},
    )

    def __init__(self, block_m: int = 64, block_n: int = 64):
        self.block_m, self.block_n = block_m, block_n

    def _forward(self, q, k, v, problem):
        o, lse = forward(q, k, v, problem, problem.seqlens_k, self.block_m, self.block_n)
        lse_out = lse if problem.is_numpy else torch.from_numpy(lse)
        return _like_input(o, problem, q), lse_out

    def _backward(self, do, q, k, v, o, lse, problem):
        grads = backward(do, q, k, v, o, lse, problem, problem.seqlens_k, self.block_m, self.block_n)
        return tuple(_like_input(g, problem, q) for g in grads)
