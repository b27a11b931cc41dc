"""What the two blocked PyTorch backends share: grouped 5-d views, tile masks, and the per-tile P and dS.

``torch_fa1`` and ``torch_fa2`` differ in their loop orders (which tiles stay resident, what is
read-modified-written), not in the arithmetic of one tile; that arithmetic lives here once.
"""

from __future__ import annotations

import torch

from ..validation import Problem
from ._tiles import key_band, tile_is_empty, tile_visibility

Tensor = torch.Tensor

DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


class TorchTiles:
    """Grouped views, tile geometry and score modifiers of one call.

    ``q``-side tensors are viewed as ``[B, Hkv, G, N, D]`` and K/V as ``[B, Hkv, 1, N, D]``; arithmetic is in
    ``acc_dtype`` (float64 for float64 inputs, float32 otherwise), one tile at a time.
    """

    def __init__(self, problem: Problem, block_m: int, block_n: int, device: torch.device):
        p = problem
        self.p, self.block_m, self.block_n, self.device = p, block_m, block_n, device
        self.acc_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        self.lse_dtype = self.acc_dtype  # the contract's lse: float64 for float64 inputs, float32 otherwise
        self.band = key_band(p.causal, p.window)
        self.seqlens = None if p.seqlens_k is None else p.seqlens_k.to(torch.int64)
        # Read the padding bounds once on the host: the loops below branch on them per tile.
        self.min_seqlen = p.seqlen_k if self.seqlens is None or p.batch == 0 else int(self.seqlens.min())
        self.max_seqlen = p.seqlen_k if self.seqlens is None or p.batch == 0 else int(self.seqlens.max())
        # ALiBi slopes per query head as [1 or B, Hkv, G, 1, 1], to broadcast over a tile.
        self.slopes = None
        if p.alibi_slopes is not None:
            self.slopes = p.alibi_slopes.to(self.acc_dtype).reshape(-1, p.kv_heads, p.group_size, 1, 1)

    def q_view(self, x: Tensor) -> Tensor:
        """q, o or do ``[B, H, Nq, D or Dv]`` as ``[B, Hkv, G, Nq, D or Dv]``."""
        p = self.p
        return x.reshape(p.batch, p.kv_heads, p.group_size, p.seqlen_q, x.shape[-1])

    def kv_view(self, x: Tensor) -> Tensor:
        return x.unsqueeze(2)

    def rows(self, m0: int) -> slice:
        return slice(m0, min(m0 + self.block_m, self.p.seqlen_q))

    def cols(self, n0: int) -> slice:
        return slice(n0, min(n0 + self.block_n, self.p.seqlen_k))

    def load(self, x: Tensor, span: slice) -> Tensor:
        """One tile of ``x`` along the sequence axis, in the accumulation dtype."""
        return x[..., span, :].to(self.acc_dtype)

    def skip(self, m0: int, n0: int) -> bool:
        """Whether tile (rows m0.., keys n0..) is fully masked (causal, window or padding): it is never loaded."""
        p, rows, cols = self.p, self.rows(m0), self.cols(n0)
        return tile_is_empty(
            rows.start, rows.stop, cols.start, cols.stop, p.seqlen_q, p.seqlen_k, self.band, self.max_seqlen
        )

    def scores(self, q_tile: Tensor, k_tile: Tensor, m0: int, n0: int) -> Tensor:
        """The tile's scores ``[B, Hkv, G, rows, cols]`` as SPEC.md defines them, invisible pairs at ``-inf``."""
        return self.scores_and_cap_derivative(q_tile, k_tile, m0, n0)[0]

    def scores_and_cap_derivative(
        self, q_tile: Tensor, k_tile: Tensor, m0: int, n0: int
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`scores` and ``d(softcap * tanh(S / softcap)) / dS = 1 - tanh^2`` (None without a soft cap), in
        SPEC.md's order: ``S = scale * q k^T``, soft cap, ALiBi ``- slope * |i' - j|``, then the masks."""
        p, rows, cols = self.p, self.rows(m0), self.cols(n0)
        s = (q_tile @ k_tile.transpose(-1, -2)) * p.scale
        cap_derivative = None
        if p.softcap:
            tanh = torch.tanh(s / p.softcap)
            s = p.softcap * tanh
            cap_derivative = 1.0 - tanh * tanh
        if self.slopes is not None:
            query_pos = torch.arange(rows.start, rows.stop, device=self.device).view(-1, 1) + (p.seqlen_k - p.seqlen_q)
            key_pos = torch.arange(cols.start, cols.stop, device=self.device).view(1, -1)
            s = s - self.slopes * (query_pos - key_pos).abs().to(self.acc_dtype)
        mask = tile_visibility(
            torch,
            rows.start,
            rows.stop,
            cols.start,
            cols.stop,
            p.seqlen_q,
            p.seqlen_k,
            self.band,
            self.seqlens,
            self.min_seqlen,
            self.device,
        )
        return (s if mask is None else s.masked_fill(~mask, float("-inf"))), cap_derivative

    @staticmethod
    def probabilities(s: Tensor, lse_tile: Tensor) -> Tensor:
        """``P = exp(S - lse)`` recomputed from the saved row log-sum-exp; exactly 0 for hidden keys and for rows
        with no visible key (``lse = -inf``), NaN in a row whose lse is NaN (a NaN input reached it)."""
        no_key = torch.isneginf(lse_tile)
        lse_safe = torch.where(no_key, torch.zeros_like(lse_tile), lse_tile)
        hidden = torch.isneginf(s) | no_key[..., None]  # exp(-inf - NaN) would be NaN for a hidden key
        return torch.where(hidden, torch.zeros_like(s), torch.exp(s - lse_safe[..., None]))

    @staticmethod
    def grad_scores(
        p: Tensor, do_tile: Tensor, v_tile: Tensor, delta_tile: Tensor, cap_derivative: Tensor | None = None
    ) -> Tensor:
        """The gradient of the raw scores ``scale * q k^T``: ``dS = P * (dP - Delta)`` with ``dP = dO @ V^T`` (the
        softmax Jacobian applied row by row), times the soft cap's derivative when there is one (ALiBi's penalty
        does not depend on q or k)."""
        dp = do_tile @ v_tile.transpose(-1, -2)
        ds = p * (dp - delta_tile[..., None])
        return ds if cap_derivative is None else ds * cap_derivative

    def finish(self, x5: Tensor) -> Tensor:
        """``[B, Hkv, G, N, D or Dv]`` back to ``[B, H, N, D or Dv]``."""
        p = self.p
        return x5.reshape(p.batch, p.heads, -1, x5.shape[-1])


def online_softmax_update(
    s: Tensor, m_i: Tensor, l_i: Tensor, acc: Tensor, v_tile: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One step of the online softmax over a new score tile ``s`` (FA2's unnormalised form).

    With ``m_new = max(m, rowmax(s))`` and ``alpha = exp(m - m_new)``: ``l <- alpha*l + rowsum(exp(s - m_new))``,
    ``acc <- alpha*acc + exp(s - m_new) @ v``.  Rows that have seen no key keep ``m = -inf``; they are shifted by
    0 instead, so ``exp(-inf - -inf)`` never makes a NaN.
    """
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m_i - shift)
    p = torch.exp(s - shift[..., None])
    l_new = alpha * l_i + p.sum(dim=-1)
    acc = alpha[..., None] * acc + p @ v_tile
    return m_new, l_new, acc


def delta_rows(do5: Tensor, o5: Tensor, acc_dtype: torch.dtype) -> Tensor:
    """``Delta_i = rowsum(dO_i * O_i)``, equal to ``rowsum(dP_i * P_i)`` since ``O_i = P_i V``."""
    return (do5.to(acc_dtype) * o5.to(acc_dtype)).sum(dim=-1)


def kv_stationary_backward(
    tiles: TorchTiles,
    q5: Tensor,
    k5: Tensor,
    v5: Tensor,
    do5: Tensor,
    lse5: Tensor,
    delta5: Tensor,
    dk: Tensor,
    dv: Tensor,
    dq_accumulator: Tensor | None = None,
) -> None:
    """Per K/V block ``j``, loop over Q blocks ``i``; write ``dK_j`` and ``dV_j`` (``[B, Hkv, Nk, D or Dv]``) once.

    ``dV_j = sum_i P_ij^T dO_i`` and ``dK_j = scale * sum_i dS_ij^T Q_i``, summed over the query heads of
    the group (axis 2).  With ``dq_accumulator`` (FA1, Algorithm 4) each visit also read-modify-writes
    ``dQ_i += scale * dS_ij K_j`` in place; FA2 leaves dQ to a Q-stationary pass instead.
    """
    p = tiles.p
    for n0 in range(0, p.seqlen_k, tiles.block_n):
        cols = tiles.cols(n0)
        k_tile, v_tile = tiles.load(k5, cols), tiles.load(v5, cols)
        dk_tile = torch.zeros(k_tile.shape[:2] + k_tile.shape[3:], dtype=tiles.acc_dtype, device=k5.device)
        dv_tile = torch.zeros(v_tile.shape[:2] + v_tile.shape[3:], dtype=tiles.acc_dtype, device=v5.device)
        for m0 in range(0, p.seqlen_q, tiles.block_m):
            if tiles.skip(m0, n0):
                continue
            rows = tiles.rows(m0)
            q_tile, do_tile = tiles.load(q5, rows), tiles.load(do5, rows)
            s, cap_derivative = tiles.scores_and_cap_derivative(q_tile, k_tile, m0, n0)
            prob = tiles.probabilities(s, lse5[..., rows])
            dv_tile += (prob.transpose(-1, -2) @ do_tile).sum(dim=2)
            ds = tiles.grad_scores(prob, do_tile, v_tile, delta5[..., rows], cap_derivative)
            if dq_accumulator is not None:
                dq_accumulator[..., rows, :] += (ds @ k_tile) * p.scale
            dk_tile += (ds.transpose(-1, -2) @ q_tile).sum(dim=2) * p.scale
        dk[:, :, cols] = dk_tile.to(dk.dtype)
        dv[:, :, cols] = dv_tile.to(dv.dtype)
