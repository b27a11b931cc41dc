"""``torch_fa2``: the FlashAttention-2 loop order as blocked PyTorch code (CPU and CUDA).

Forward (FA2, Algorithm 1): the outer loop is over Q blocks, so a Q block's running max ``m``, sum
``l`` and unnormalised output stay local to the loop body and are written once; the inner loop streams
K/V blocks.  Normalisation by ``l`` is deferred to the end, and ``lse = m + log(l)`` is saved for the
backward instead of ``m`` and ``l``.

Backward (FA2, Algorithm 2, split in two passes as the no-atomic GPU kernels do):
1. preprocess ``Delta = rowsum(dO * O)``;
2. a K/V-stationary pass: per K/V block, loop over Q blocks, accumulate dK, dV, write them once;
3. a Q-stationary pass: per Q block, loop over K/V blocks, accumulate dQ, write it once.
"""

from __future__ import annotations

import torch

from ..backend import Backend, Capabilities, new_output, register
from ..kvcache import per_sequence_forward
from ._torch_blocked import DTYPES, TorchTiles, delta_rows, kv_stationary_backward, online_softmax_update

Tensor = torch.Tensor


def forward(q: Tensor, k: Tensor, v: Tensor, tiles: TorchTiles) -> tuple[Tensor, Tensor]:
    """Returns ``o`` ``[B, H, Nq, Dv]`` (dtype of q) and ``lse`` ``[B, H, Nq]`` (float64 for float64 inputs, else
    float32)."""
    q5, k5, v5 = tiles.q_view(q), tiles.kv_view(k), tiles.kv_view(v)
    o5 = new_output(q5.shape[:-1] + v5.shape[-1:], q.dtype, q.device)
    lse5 = new_output(q5.shape[:-1], tiles.lse_dtype, q.device)
    for m0 in range(0, tiles.p.seqlen_q, tiles.block_m):
        rows = tiles.rows(m0)
        q_tile = tiles.load(q5, rows)
        m_i = torch.full(q_tile.shape[:-1], float("-inf"), dtype=tiles.acc_dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_tile.shape[:-1] + v5.shape[-1:], dtype=tiles.acc_dtype, device=q.device)
        for n0 in range(0, tiles.p.seqlen_k, tiles.block_n):
            if tiles.skip(m0, n0):
                continue
            cols = tiles.cols(n0)
            s = tiles.scores(q_tile, tiles.load(k5, cols), m0, n0)
            m_i, l_i, acc = online_softmax_update(s, m_i, l_i, acc, tiles.load(v5, cols))
        # Deferred normalisation: one division per row at the end.  l = 0 exactly for a row with no key; a NaN
        # score makes l NaN, which fails the test, so the NaN reaches o and lse.
        empty = l_i == 0
        l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
        o5[..., rows, :] = torch.where(empty[..., None], 0.0, acc / l_safe[..., None]).to(q.dtype)
        lse5[..., rows] = torch.where(empty, float("-inf"), m_i + torch.log(l_safe)).to(tiles.lse_dtype)
    return tiles.finish(o5), lse5.reshape(tiles.p.batch, tiles.p.heads, tiles.p.seqlen_q)


def backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, tiles: TorchTiles
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``dq`` ``[B, H, Nq, D]`` and ``dk``, ``dv`` ``[B, Hkv, Nk, D]`` in the input dtype."""
    p = tiles.p
    q5, k5, v5, do5 = tiles.q_view(q), tiles.kv_view(k), tiles.kv_view(v), tiles.q_view(do)
    lse5 = lse.reshape(q5.shape[:-1]).to(tiles.acc_dtype)
    delta5 = delta_rows(do5, tiles.q_view(o), tiles.acc_dtype)
    dq5 = new_output(q5.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)

    # Pass 1, K/V stationary: dK and dV.
    kv_stationary_backward(tiles, q5, k5, v5, do5, lse5, delta5, dk, dv)

    # Pass 2, Q stationary: dQ_i = scale * sum_j dS_ij K_j.
    for m0 in range(0, p.seqlen_q, tiles.block_m):
        rows = tiles.rows(m0)
        q_tile, do_tile = tiles.load(q5, rows), tiles.load(do5, rows)
        dq_tile = torch.zeros_like(q_tile)
        for n0 in range(0, p.seqlen_k, tiles.block_n):
            if tiles.skip(m0, n0):
                continue
            cols = tiles.cols(n0)
            k_tile, v_tile = tiles.load(k5, cols), tiles.load(v5, cols)
            s, cap_derivative = tiles.scores_and_cap_derivative(q_tile, k_tile, m0, n0)
            prob = tiles.probabilities(s, lse5[..., rows])
            ds = tiles.grad_scores(prob, do_tile, v_tile, delta5[..., rows], cap_derivative)
            dq_tile += (ds @ k_tile) * p.scale
        dq5[..., rows, :] = dq_tile.to(q.dtype)
    return tiles.finish(dq5), dk, dv


@register
class TorchFA2(Backend):
    """FlashAttention-2 loop order in PyTorch: outer Q, inner K/V, deferred normalisation, LSE saved."""

    name = "torch_fa2"
    capabilities = Capabilities(
        summary="PyTorch blocked, FA2 order: outer Q / inner K/V; backward Delta + dK/dV pass + dQ pass",
        devices=frozenset({"cpu", "cuda"}),
        dtypes=DTYPES,
        kvcache=True,
        kvcache_auto_rank={"cpu": 10, "cuda": 10},
        auto_rank={"cpu": 10, "cuda": 10},
    )

    def __init__(self, block_m: int = 64, block_n: int = 64):
        self.block_m, self.block_n = block_m, block_n

    def _tiles(self, q, problem) -> TorchTiles:
        return TorchTiles(problem, self.block_m, self.block_n, q.device)

    def _forward(self, q, k, v, problem):
        return forward(q, k, v, self._tiles(q, problem))

    def kvcache_forward(self, q, k_cache, v_cache, lengths, block_table, kv):
        # Each sequence's pages gathered into a dense tensor of its attended length, then the plain forward.
        return per_sequence_forward(self, q, k_cache, v_cache, lengths, block_table, kv)

    def _backward(self, do, q, k, v, o, lse, problem):
        return backward(do, q, k, v, o, lse, self._tiles(q, problem))
