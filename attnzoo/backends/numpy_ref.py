"""``numpy_ref``: the online-softmax algorithm in pure NumPy, and its explicit backward.

Forward, for each block of query rows, streams over K/V blocks and keeps per row a running max ``m``,
a running sum ``l`` of ``exp(s - m)`` and an unnormalised output ``acc``.  When a new block raises the
max from ``m`` to ``m_new``, everything gathered so far is rescaled by ``alpha = exp(m - m_new)``:

    l   <- alpha * l   + rowsum(exp(s - m_new))
    acc <- alpha * acc + exp(s - m_new) @ v_tile

At the end ``o = acc / l`` and ``lse = m + log(l)``.  No ``N x N`` array is ever formed: the largest
temporaries are ``[B, H, block_m, block_n]`` score tiles.

The scores of a tile are SPEC.md's, in its order (:meth:`_Geometry.scores`): ``S = scale * q @ k^T``, then the
soft cap ``softcap * tanh(S / softcap)``, then the ALiBi penalty ``- slope * |i' - j|``, then the masks (causal,
window, padding) as ``-inf``.  Nothing else in the algorithm knows about the modifiers: the online softmax runs on
whatever scores it is given.

Backward recomputes each tile's probabilities from the saved ``lse`` (``P = exp(S - lse)``, with the same modified
``S``), and uses ``Delta = rowsum(dO * O)`` (equal to ``rowsum(dP * P)``) so that ``dS = P * (dP - Delta)`` needs no
second pass over K/V.  That ``dS`` is the gradient of the modified score; ALiBi's penalty does not depend on q or k,
and the soft cap multiplies it by its derivative ``1 - tanh^2(S / softcap)`` (recomputed, nothing extra is stored).
"""

from __future__ import annotations

import numpy as np
import torch

from ..backend import Backend, Capabilities, poison_outputs, register
from ..kvcache import per_sequence_forward
from ..validation import Problem
from ._tiles import key_band, tile_is_empty, tile_visibility


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
    """The 5-d grouped views, the score modifiers and the mask parameters of one call."""

    def __init__(self, problem: Problem, block_m: int, block_n: int):
        p = problem
        self.p, self.block_m, self.block_n = p, block_m, block_n
        self.acc = np.float64 if p.dtype == torch.float64 else np.float32
        self.band = key_band(p.causal, p.window)
        self.seqlens = None if p.seqlens_k is None else _to_numpy(p.seqlens_k, np.int64)
        self.min_seqlen = p.seqlen_k if self.seqlens is None else int(self.seqlens.min(initial=p.seqlen_k))
        self.max_seqlen = p.seqlen_k if self.seqlens is None else int(self.seqlens.max(initial=0))
        # ALiBi slopes per query head, [1 or B, Hkv, G, 1, 1] to broadcast over a tile of the grouped view.
        self.slopes = None
        if p.alibi_slopes is not None:
            slopes = _to_numpy(p.alibi_slopes, self.acc)
            self.slopes = slopes.reshape(-1, p.kv_heads, p.group_size, 1, 1)

    def q_view(self, x) -> np.ndarray:
        """q, o or do ``[B, H, Nq, D or Dv]`` as ``[B, Hkv, G, Nq, D or Dv]``."""
        p, x = self.p, _to_numpy(x, self.acc)
        return x.reshape(p.batch, p.kv_heads, p.group_size, p.seqlen_q, x.shape[-1])

    def kv_view(self, x) -> np.ndarray:
        """k or v ``[B, Hkv, Nk, D or Dv]`` as ``[B, Hkv, 1, Nk, D or Dv]``."""
        return _to_numpy(x, self.acc)[:, :, None]

    def skip(self, m0: int, n0: int) -> bool:
        """Whether no row of the tile at rows ``m0``, keys ``n0`` sees any of its keys."""
        p = self.p
        m1, n1 = min(m0 + self.block_m, p.seqlen_q), min(n0 + self.block_n, p.seqlen_k)
        return tile_is_empty(m0, m1, n0, n1, p.seqlen_q, p.seqlen_k, self.band, self.max_seqlen)

    def scores(self, q_tile: np.ndarray, k_tile: np.ndarray, m0: int, n0: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The tile's scores ``[B, Hkv, G, rows, cols]`` as SPEC.md defines them, hidden pairs at ``-inf``; and
        ``dS_capped / dS`` (None without a soft cap), which the backward's chain rule needs."""
        p = self.p
        m1, n1 = m0 + q_tile.shape[-2], n0 + k_tile.shape[-2]
        s = (q_tile @ k_tile.swapaxes(-1, -2)) * p.scale
        cap_derivative = None
        if p.softcap:
            # Soft cap (Gemma 2, Grok): softcap * tanh(S / softcap) squashes S smoothly into (-softcap, softcap) and
            # is close to S for |S| << softcap.  Its derivative is 1 - tanh^2.  (S / softcap may overflow to inf for
            # a tiny cap; tanh(inf) = 1 is then the right limit.)
            with np.errstate(over="ignore"):
                tanh = np.tanh(s / p.softcap)
            s = p.softcap * tanh
            cap_derivative = 1.0 - tanh * tanh
        if self.slopes is not None:
            # ALiBi (BLOOM, MPT): a penalty growing linearly with the distance from the query to the key.  The query's
            # position is i' = i + (Nk - Nq), aligned to the bottom-right corner like causal: when Nq < Nk the queries
            # are the last Nq positions of the sequence (decoding with a KV cache), so the last row sits at the last
            # key.  It is added before the masks, so that a hidden key stays exactly -inf.
            query_pos = np.arange(m0, m1).reshape(-1, 1) + (p.seqlen_k - p.seqlen_q)
            key_pos = np.arange(n0, n1).reshape(1, -1)
            s = s - self.slopes * np.abs(query_pos - key_pos).astype(self.acc)
        visible = tile_visibility(np, m0, m1, n0, n1, p.seqlen_q, p.seqlen_k, self.band, self.seqlens, self.min_seqlen)
        if visible is not None:
            s = np.where(visible, s, -np.inf)
        return s, cap_derivative


def forward(q, k, v, problem: Problem, block_m: int = 64, block_n: int = 64):
    """Online-softmax forward.  Returns ``o`` ``[B, H, Nq, Dv]`` and ``lse`` ``[B, H, Nq]``, NumPy arrays in the
    accumulation dtype (float64 for float64 inputs, float32 otherwise: the contract's lse dtype)."""
    geo = _Geometry(problem, block_m, block_n)
    q5, k5, v5 = geo.q_view(q), geo.kv_view(k), geo.kv_view(v)
    o = _output(q5.shape[:-1] + v5.shape[-1:], geo.acc)
    lse = _output(q5.shape[:-1], geo.acc)
    for m0 in range(0, problem.seqlen_q, block_m):
        q_tile = q5[..., m0 : m0 + block_m, :]
        m_i = np.full(q_tile.shape[:-1], -np.inf, geo.acc)
        l_i = np.zeros(q_tile.shape[:-1], geo.acc)
        acc = np.zeros(q_tile.shape[:-1] + v5.shape[-1:], geo.acc)
        for n0 in range(0, problem.seqlen_k, block_n):
            if geo.skip(m0, n0):
                continue
            k_tile, v_tile = k5[..., n0 : n0 + block_n, :], v5[..., n0 : n0 + block_n, :]
            s, _ = geo.scores(q_tile, k_tile, m0, n0)
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
    shape = (problem.batch, problem.heads, problem.seqlen_q)
    return o.reshape(*shape, problem.head_dim_v), lse.reshape(shape)


def backward(do, q, k, v, o, lse, problem: Problem, block_m: int = 64, block_n: int = 64):
    """Explicit backward, K/V blocks outside and Q blocks inside.  Returns NumPy ``dq, dk, dv``."""
    geo = _Geometry(problem, block_m, block_n)
    q5, k5, v5 = geo.q_view(q), geo.kv_view(k), geo.kv_view(v)
    do5, o5 = geo.q_view(do), geo.q_view(o)
    lse5 = _to_numpy(lse, geo.acc).reshape(q5.shape[:-1])
    # Delta_i = sum_j P_ij dP_ij = sum_j P_ij (dO_i . V_j) = dO_i . O_i: one pass over O instead of over K/V.
    delta = (do5 * o5).sum(axis=-1)
    # Rows with no visible key have lse = -inf and P = 0; a finite stand-in keeps exp() NaN-free.
    lse_safe = np.where(np.isneginf(lse5), 0.0, lse5)
    dq = np.zeros(q5.shape, geo.acc)
    dk = _output(k5[:, :, 0].shape, geo.acc)
    dv = _output(v5[:, :, 0].shape, geo.acc)
    for n0 in range(0, problem.seqlen_k, block_n):
        k_tile, v_tile = k5[..., n0 : n0 + block_n, :], v5[..., n0 : n0 + block_n, :]
        dk_tile = np.zeros(dk[..., n0 : n0 + block_n, :].shape, geo.acc)
        dv_tile = np.zeros(dv[..., n0 : n0 + block_n, :].shape, geo.acc)
        for m0 in range(0, problem.seqlen_q, block_m):
            if geo.skip(m0, n0):
                continue
            rows = slice(m0, m0 + block_m)
            q_tile, do_tile = q5[..., rows, :], do5[..., rows, :]
            s, cap_derivative = geo.scores(q_tile, k_tile, m0, n0)
            # P = exp(S - lse), exactly 0 for hidden keys (S = -inf) and for rows with no visible key: their exponent
            # is set to -inf first (lse_safe = 0 there, and exp(S - 0) could overflow; and a hidden key of a row whose
            # lse is NaN stays 0, as exp(-inf - NaN) would not).
            hidden = np.isneginf(lse5[..., rows, None]) | np.isneginf(s)
            p = np.exp(np.where(hidden, -np.inf, s - lse_safe[..., rows, None]))
            dv_tile += (p.swapaxes(-1, -2) @ do_tile).sum(axis=2)
            dp = do_tile @ v_tile.swapaxes(-1, -2)
            ds = p * (dp - delta[..., rows, None])  # the gradient of the modified score
            if cap_derivative is not None:
                ds = ds * cap_derivative  # chain rule through softcap * tanh(S / softcap)
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
        kvcache=True,
        kvcache_auto_rank={"cpu": 30},
        auto_rank={"cpu": 30},
    )

    def __init__(self, block_m: int = 64, block_n: int = 64):
        self.block_m, self.block_n = block_m, block_n

    def _forward(self, q, k, v, problem):
        o, lse = forward(q, k, v, problem, self.block_m, self.block_n)
        lse_out = lse if problem.is_numpy else torch.from_numpy(lse)
        return _like_input(o, problem, q), lse_out

    def kvcache_forward(self, q, k_cache, v_cache, lengths, block_table, kv):
        # Each sequence's pages gathered into a dense tensor of its attended length, then the plain forward.
        return per_sequence_forward(self, q, k_cache, v_cache, lengths, block_table, kv)

    def _backward(self, do, q, k, v, o, lse, problem):
        grads = backward(do, q, k, v, o, lse, problem, self.block_m, self.block_n)
        return tuple(_like_input(g, problem, q) for g in grads)
