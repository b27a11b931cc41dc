"""The test oracle: exact attention that materialises S and P.

``reference`` computes in float64 on the CPU and is the judge of every backend; ``plain_torch`` runs
the same textbook formulas in the inputs' own dtype (what "plain PyTorch" gives) and sets the error
budget of low-precision results (SPEC.md: at most 2x its error, plus a small slack).  Both hold the
whole ``[B, H, Nq, Nk]`` score matrix, so they are for tests and ``compare``, never for large N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Tensor = torch.Tensor


def visible_mask(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    seqlens_k: Tensor | None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Boolean ``[B, 1, Nq, Nk]``: whether query row ``i`` of batch ``b`` may see key ``j``.

    Causal is aligned to the bottom-right corner: ``j <= i + (Nk - Nq)``; ``seqlens_k`` masks ``j >= seqlens_k[b]``.
    """
    rows = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    cols = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    mask = torch.ones(batch, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        mask = mask & (cols <= rows + (seqlen_k - seqlen_q))
    if seqlens_k is not None:
        mask = mask & (cols < seqlens_k.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1))
    return mask


@dataclass
class Result:
    """Outputs of one oracle run; gradients are None when no ``do`` was given."""

    o: Tensor
    lse: Tensor
    dq: Tensor | None = None
    dk: Tensor | None = None
    dv: Tensor | None = None


def _as_torch(x) -> Tensor:
    return torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x


def _explicit(q, k, v, do, causal, scale, seqlens_k, compute_dtype) -> Result:
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = H // Hkv
    if scale is None:
        scale = D**-0.5
    # Grouped-query attention: query head h reads K/V head h // group.
    k_full = k.to(compute_dtype).repeat_interleave(group, dim=1)
    v_full = v.to(compute_dtype).repeat_interleave(group, dim=1)
    q = q.to(compute_dtype)
    seqlens = None if seqlens_k is None else _as_torch(seqlens_k).cpu()
    mask = visible_mask(B, Nq, Nk, causal, seqlens, q.device)
    s = (q @ k_full.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    # lse is float32 in the contract; the row max is subtracted in float64 first so that the
    # softmax below is exact.  A row with no visible key has lse = -inf and P = 0.
    lse = torch.logsumexp(s.double(), dim=-1)
    has_key = torch.isfinite(lse)
    p = torch.where(has_key[..., None], torch.exp(s.double() - lse[..., None].where(has_key[..., None], 0)), 0.0)
    p = p.to(compute_dtype)
    o = p @ v_full
    result = Result(o=o, lse=lse.float())
    if do is not None:
        do = do.to(compute_dtype)
        dv_full = p.transpose(-1, -2) @ do
        dp = do @ v_full.transpose(-1, -2)
        delta = (dp.double() * p.double()).sum(-1, keepdim=True)
        ds = (p.double() * (dp.double() - delta)).to(compute_dtype)
        dq = (ds @ k_full) * scale
        dk_full = (ds.transpose(-1, -2) @ q) * scale
        result.dq = dq
        result.dk = dk_full.view(B, Hkv, group, Nk, D).sum(2)
        result.dv = dv_full.view(B, Hkv, group, Nk, D).sum(2)
    return result


def reference(q, k, v, do=None, causal: bool = False, scale: float | None = None, seqlens_k=None) -> Result:
    """Exact attention in float64 on the CPU (the judge).  Accepts torch tensors or numpy arrays.

    q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``; do (optional): ``[B, H, Nq, D]``.
    Returns float64 CPU tensors (lse float32 as in the contract, computed in float64).
    """
    q, k, v = (_as_torch(x).detach().cpu().double() for x in (q, k, v))
    do = None if do is None else _as_torch(do).detach().cpu().double()
    return _explicit(q, k, v, do, causal, scale, seqlens_k, torch.float64)


def plain_torch(q, k, v, do=None, causal: bool = False, scale: float | None = None, seqlens_k=None) -> Result:
    """The same formulas with every matrix product in the inputs' dtype and on their device.

    This is the error baseline of SPEC.md's rule for float16 and bfloat16: a backend may be at most
    twice as far from :func:`reference` as this is, plus a small slack.
    """
    q, k, v = (_as_torch(x).detach() for x in (q, k, v))
    do = None if do is None else _as_torch(do).detach()
    return _explicit(q, k, v, do, causal, scale, seqlens_k, q.dtype)
