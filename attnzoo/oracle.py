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


# -- SPEC.md's error rule -------------------------------------------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Rounding unit of each dtype: the absolute slack of the low-precision rule (relative to the reference's
# largest magnitude, at least 1).
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# Fixed tolerances for float32 and float64, relative to the same magnitude.  float32: sums of up to a few
# hundred products.  float64: the backward reads the float32 lse of the contract, so P = exp(S - lse)
# carries one float32 rounding; the forward is held to float64 accuracy.
FIXED_TOL = {
    torch.float32: {"o": 2e-5, "lse": 2e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4},
    torch.float64: {"o": 1e-10, "lse": 2e-6, "dq": 2e-5, "dk": 2e-5, "dv": 2e-5},
}


@dataclass
class Check:
    """One output compared with the oracle: its max error, the bound it must meet, and why it failed."""

    error: float
    bound: float
    message: str = ""

    @property
    def ok(self) -> bool:
        return not self.message and self.error <= self.bound

    @property
    def ratio(self) -> float:
        return self.error / self.bound if self.bound else 0.0


def error_bound(name: str, ref: Tensor, baseline: Tensor | None, dtype: torch.dtype) -> float:
    """SPEC.md's rule.  float16/bfloat16: twice the max error of :func:`plain_torch` (``baseline``) plus one
    rounding unit; float32/float64: a fixed tolerance.  Both relative to ``max(1, max|ref|)``."""
    magnitude = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    if dtype in LOW_PRECISION:
        base_err = float((baseline.double().cpu() - ref).abs().max()) if ref.numel() else 0.0
        return 2.0 * base_err + EPS[dtype] * magnitude
    return FIXED_TOL[dtype][name] * magnitude


def check_output(name: str, got, ref: Tensor, baseline, dtype: torch.dtype) -> Check:
    """Compare output ``name`` ("o", "lse", "dq", "dk" or "dv") of a backend with the oracle's ``ref``.

    ``baseline`` is :func:`plain_torch`'s same output (needed for float16/bfloat16).  NaN anywhere fails;
    for ``lse`` the rows with no visible key must be exactly ``-inf`` and are left out of the error.
    """
    got = _as_torch(got).detach().cpu().double()
    if got.shape != ref.shape:
        return Check(float("inf"), 0.0, f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    if torch.isnan(got).any():
        return Check(float("nan"), 0.0, f"NaN in {int(torch.isnan(got).sum())} elements")
    if baseline is not None:
        baseline = _as_torch(baseline).detach().cpu().double()
    if name == "lse":
        no_key = torch.isneginf(ref)
        if not torch.equal(torch.isneginf(got), no_key):
            return Check(float("inf"), 0.0, "lse is not -inf exactly on the rows that see no key")
        ref, got = ref[~no_key], got[~no_key]
        baseline = None if baseline is None else baseline[~no_key]
    error = float((got - ref).abs().max()) if ref.numel() else 0.0
    bound = error_bound(name, ref, baseline, dtype)
    message = "" if error <= bound else f"max error {error:.3e} > bound {bound:.3e}"
    return Check(error, bound, message)
