"""``torch_fa1``: the FlashAttention-1 loop order as blocked PyTorch code (CPU and CUDA).

Forward (FA1, Algorithm 1): the outer loop is over K/V blocks, the inner over Q blocks.  Every Q
block's output ``O``, row sum ``l`` and row max ``m`` live in full-size tensors (HBM in the paper) and
are read, updated and written back once per K/V block, normalised each time:

    m_new = max(m, m~),  l_new = exp(m - m_new) l + exp(m~ - m_new) l~
    O    <- (l exp(m - m_new) O + exp(m~ - m_new) P~ V_j) / l_new

where ``m~``, ``P~ = exp(S - m~)``, ``l~`` are the block's own max, probabilities and sum.  That repeated
read-modify-write of O is what FA2 removed.  The contract saves ``lse = m + log(l)``.

Backward (FA1, Algorithm 4): outer K/V, inner Q; dK_j and dV_j accumulate on chip and are written once,
while dQ_i is read, updated and written back in place for every K/V block.
"""

from __future__ import annotations

import torch

from ..backend import Backend, Capabilities, new_output, register
from ._torch_blocked import DTYPES, TorchTiles, delta_rows, kv_stationary_backward

Tensor = torch.Tensor


def forward(q: Tensor, k: Tensor, v: Tensor, tiles: TorchTiles) -> tuple[Tensor, Tensor]:
    """Returns ``o`` ``[B, H, Nq, Dv]`` (dtype of q) and ``lse`` ``[B, H, Nq]`` (float64 for float64 inputs, else
    float32)."""
    q5, k5, v5 = tiles.q_view(q), tiles.kv_view(k), tiles.kv_view(v)
    acc_dtype = tiles.acc_dtype
    o5 = torch.zeros(q5.shape[:-1] + v5.shape[-1:], dtype=acc_dtype, device=q.device)
    l_all = torch.zeros(q5.shape[:-1], dtype=acc_dtype, device=q.device)
    m_all = torch.full(q5.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    for n0 in range(0, tiles.p.seqlen_k, tiles.block_n):
        cols = tiles.cols(n0)
        k_tile, v_tile = tiles.load(k5, cols), tiles.load(v5, cols)
        for m0 in range(0, tiles.p.seqlen_q, tiles.block_m):
            if tiles.skip(m0, n0):
                continue
            rows = tiles.rows(m0)
            s = tiles.scores(tiles.load(q5, rows), k_tile, m0, n0)
            m_blk = s.amax(dim=-1)
            # Guard rows whose keys in this block are all masked: m~ = -inf would give exp(-inf - -inf).
            m_blk_safe = torch.where(torch.isneginf(m_blk), torch.zeros_like(m_blk), m_blk)
            p_blk = torch.exp(s - m_blk_safe[..., None])
            l_blk = p_blk.sum(dim=-1)
            m_old, l_old = m_all[..., rows], l_all[..., rows]
            m_new = torch.maximum(m_old, m_blk)
            m_new_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            old_scale = torch.exp(m_old - m_new_safe) * l_old
            # l = 0 exactly where no key was seen; a NaN score makes l NaN, which these tests let through.
            blk_scale = torch.where(l_blk == 0, torch.zeros_like(l_blk), torch.exp(m_blk_safe - m_new_safe))
            l_new = old_scale + blk_scale * l_blk
            l_div = torch.where(l_new == 0, torch.ones_like(l_new), l_new)
            o5[..., rows, :] = (old_scale[..., None] * o5[..., rows, :] + blk_scale[..., None] * (p_blk @ v_tile)) / (
                l_div[..., None]
            )
            m_all[..., rows], l_all[..., rows] = m_new, l_new
    empty = l_all == 0
    lse = torch.where(empty, float("-inf"), m_all + torch.log(torch.where(empty, torch.ones_like(l_all), l_all)))
    lse = lse.to(tiles.lse_dtype).reshape(tiles.p.batch, tiles.p.heads, tiles.p.seqlen_q)
    return tiles.finish(o5.to(q.dtype)), lse


def backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, tiles: TorchTiles
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``dq`` ``[B, H, Nq, D]`` and ``dk``, ``dv`` ``[B, Hkv, Nk, D]`` in the input dtype."""
    q5, k5, v5, do5 = tiles.q_view(q), tiles.kv_view(k), tiles.kv_view(v), tiles.q_view(do)
    lse5 = lse.reshape(q5.shape[:-1]).to(tiles.acc_dtype)
    delta5 = delta_rows(do5, tiles.q_view(o), tiles.acc_dtype)
    dq5 = torch.zeros(q5.shape, dtype=tiles.acc_dtype, device=q.device)  # updated in place, block by block
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    # Outer K/V, inner Q: dK_j, dV_j stay on chip, dQ_i goes back to memory after every K/V block.
    kv_stationary_backward(tiles, q5, k5, v5, do5, lse5, delta5, dk, dv, dq_accumulator=dq5)
    return tiles.finish(dq5.to(q.dtype)), dk, dv


@register
class TorchFA1(Backend):
    """FlashAttention-1 loop order in PyTorch: outer K/V, inner Q, O/l/m read-modify-written per block."""

    name = "torch_fa1"
    capabilities = Capabilities(
        summary="PyTorch blocked, FA1 order: outer K/V / inner Q, O, l, m updated in place; backward Algorithm 4",
        devices=frozenset({"cpu", "cuda"}),
        dtypes=DTYPES,
        auto_rank={"cpu": 20, "cuda": 20},
    )

    def __init__(self, block_m: int = 64, block_n: int = 64):
        self.block_m, self.block_n = block_m, block_n

    def _forward(self, q, k, v, problem):
        return forward(q, k, v, TorchTiles(problem, self.block_m, self.block_n, q.device))

    def _backward(self, do, q, k, v, o, lse, problem):
        return backward(do, q, k, v, o, lse, TorchTiles(problem, self.block_m, self.block_n, q.device))
