"""The test oracle: exact attention that materialises S and P.

``reference`` computes in float64 on the CPU and is the judge of every backend; ``plain_torch`` runs
the same textbook formulas in the inputs' own dtype (what "plain PyTorch" gives) and sets the error
budget of low-precision results (SPEC.md: at most 2x its error, plus a small slack).  Both hold the
whole ``[B, H, Nq, Nk]`` score matrix, so they are for tests and ``compare``; ``reference_chunked`` and
``plain_torch_chunked`` compute the same one head at a time, for the GPU tests' long sequences.
``attnzoo.testing`` runs them on a backend's outputs.
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
    window: tuple[int | None, int | None] | None = None,
) -> Tensor:
    """Boolean ``[B, 1, Nq, Nk]``: whether query row ``i`` of batch ``b`` may see key ``j`` (SPEC.md, literally).

    With ``i' = i + (Nk - Nq)``: causal keeps ``j <= i'`` (bottom-right aligned); ``window=(left, right)`` keeps
    ``i' - left <= j <= i' + right`` (None: that side unbounded); ``seqlens_k`` keeps ``j < seqlens_k[b]``.
    """
    i_aligned = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    mask = torch.ones(batch, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        mask = mask & (j <= i_aligned)
    if window is not None:
        left, right = window
        if left is not None:
            mask = mask & (i_aligned - left <= j)
        if right is not None:
            mask = mask & (j <= i_aligned + right)
    if seqlens_k is not None:
        mask = mask & (j < seqlens_k.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1))
    return mask


def alibi_bias(
    alibi_slopes, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu"
) -> Tensor:
    """ALiBi's term of the scores, float64 ``[B or 1, H, Nq, Nk]``: ``-slope[b, h] * |i' - j|``."""
    slopes = _as_torch(alibi_slopes).to(device, torch.float64)
    slopes = slopes.view(-1, heads, 1, 1)  # [H] -> [1, H, 1, 1]; [B, H] -> [B, H, 1, 1]
    i_aligned = torch.arange(seqlen_q, device=device).view(-1, 1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    return -slopes * (i_aligned - j).abs().to(torch.float64)


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


def reference(
    q,
    k,
    v,
    do=None,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k=None,
    stored_dtype=None,
    device: torch.device | str = "cpu",
    stored_o=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
) -> Result:
    """Exact attention in float64 (the judge), on the CPU unless ``device`` says otherwise (the GPU tests judge
    large N on the GPU).  Accepts torch tensors or numpy arrays.

    q: ``[B, H, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``; do (optional): ``[B, H, Nq, Dv]``.
    ``window``, ``softcap``, ``alibi_slopes``: SPEC.md's score modifiers, applied in its order.
    Returns float64 tensors on ``device``; lse is computed in float64 and returned in the contract's dtype
    (float64 for float64 inputs, float32 otherwise).

    ``stored_dtype``: compute the backward's ``Delta = rowsum(dO * O)`` from ``dO`` and ``O`` rounded to this
    dtype and summed in float32, as every backend does (the contract hands the backward the forward's ``o`` in
    the input dtype), instead of the exact ``rowsum(dP * P)``; the difference is the error this step brings.
    ``stored_o``: the ``o`` a backend's forward returned, to use there instead of the exact ``o`` rounded to
    ``stored_dtype`` (a backend's ``o`` may round to the other side, and its backward is handed its own ``o``).
    """
    input_dtype = _as_torch(q).dtype
    q, k, v = (_as_torch(x).detach().to(device, torch.float64) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    scale = D**-0.5 if scale is None else scale
    # Grouped-query attention: query head h reads K/V head h // group.
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seqlens = None if seqlens_k is None else _as_torch(seqlens_k).to(device)
    mask = visible_mask(B, Nq, Nk, causal, seqlens, device, window)
    s = (q @ k_full.transpose(-1, -2)) * scale
    # SPEC.md's order: soft cap, then ALiBi, then the masks.  d(capped)/dS = 1 - tanh^2 for the backward.
    cap_derivative = None
    if softcap:
        tanh = torch.tanh(s / softcap)
        s, cap_derivative = softcap * tanh, 1.0 - tanh**2
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, B, H, Nq, Nk, device)
    s = s.masked_fill(~mask, float("-inf"))
    # A row with no visible key has lse = -inf and P = 0; a hidden key has P = 0 exactly, also in a row whose lse
    # is NaN (a NaN input reached it), so that a NaN reaches the rows that see it and no others.
    lse = torch.logsumexp(s, dim=-1)
    no_key = torch.isneginf(lse)[..., None]
    p = torch.where(mask & ~no_key, torch.exp(s - lse[..., None].where(~no_key, 0.0)), 0.0)
    o = p @ v_full
    result = Result(o=o, lse=lse if input_dtype == torch.float64 else lse.float())
    if do is not None:
        do = _as_torch(do).detach().to(device, torch.float64)
        dv_full = p.transpose(-1, -2) @ do
        dp = do @ v_full.transpose(-1, -2)
        if stored_dtype is None:
            delta = (dp * p).sum(-1, keepdim=True)
        else:  # what a backend can do: dO and O as stored, summed in float32 (float64 for float64 inputs)
            acc = torch.float64 if stored_dtype == torch.float64 else torch.float32
            stored_o = o.to(stored_dtype) if stored_o is None else _as_torch(stored_o).detach().to(device)
            stored_o, stored_do = stored_o.to(acc), do.to(stored_dtype).to(acc)
            delta = (stored_do * stored_o).sum(-1, keepdim=True).double()
        ds = p * (dp - delta)
        if cap_derivative is not None:
            ds = ds * cap_derivative
        result.dq = (ds @ k_full) * scale
        result.dk = ((ds.transpose(-1, -2) @ q) * scale).view(B, Hkv, group, Nk, D).sum(2)
        result.dv = dv_full.view(B, Hkv, group, Nk, Dv).sum(2)
    return result


def plain_torch(
    q,
    k,
    v,
    do=None,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
) -> Result:
    """Textbook attention as plain PyTorch runs it in the inputs' dtype, on their device: matrix products and
    softmax in that dtype (PyTorch accumulates them in float32 and rounds the result), the ALiBi term in that dtype
    too, the soft cap in float32 rounded to it, gradients by autograd.

    This is the error baseline of SPEC.md's rule for float16 and bfloat16: a backend may be at most twice as
    far from :func:`reference` as this is, plus a small slack.
    """
    q, k, v = (_as_torch(x).detach().requires_grad_() for x in (q, k, v))
    B, H, Nq, D = q.shape
    group = H // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    seqlens = None if seqlens_k is None else _as_torch(seqlens_k).to(q.device)
    mask = visible_mask(B, Nq, k.shape[2], causal, seqlens, q.device, window)
    with torch.enable_grad():
        k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = (q @ k_full.transpose(-1, -2)) * scale
        if softcap:
            # Half precision: in float32, rounded back (in float16 autograd's softcap * dtanh overflowed for caps
            # near 1e4, so that the bound was inf); the kernels compute the cap in float32 too.
            wide = s.float() if s.dtype in LOW_PRECISION else s
            s = (softcap * torch.tanh(wide / softcap)).to(s.dtype)
        if alibi_slopes is not None:
            s = s + alibi_bias(alibi_slopes, B, H, Nq, k.shape[2], q.device).to(s.dtype)
        has_key = mask.any(dim=-1, keepdim=True)
        # softmax over a row with no visible key would be 0/0: such rows get P = 0, as in the contract.
        s = s.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
        p = torch.softmax(s, dim=-1) * has_key
        o = p @ v_full
    lse = torch.logsumexp(s.detach().float(), dim=-1).masked_fill(~has_key[..., 0], float("-inf"))
    result = Result(o=o.detach(), lse=lse)
    if do is not None:
        result.dq, result.dk, result.dv = torch.autograd.grad(o, (q, k, v), _as_torch(do).to(o.dtype))
    return result


def _by_head(compute, q, k, v, do, seqlens_k, stored_o, device, alibi_slopes=None) -> Result:
    """``compute(q, k, v, do, seqlens_k, stored_o, slopes)`` on one (batch, query head) at a time, assembled into one
    :class:`Result` on ``device``: o, dq float64 per query head, dk and dv summed over each K/V group in float64.
    ``slopes`` is the ``[1, 1]`` ALiBi slope of that head (None without ALiBi)."""
    q, k, v = (_as_torch(x) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    f64 = dict(dtype=torch.float64, device=device)
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    result = Result(o=torch.zeros(B, H, Nq, Dv, **f64), lse=torch.zeros(B, H, Nq, dtype=lse_type, device=device))
    if do is not None:
        result.dq, result.dk, result.dv = (
            torch.zeros(B, H, Nq, D, **f64),
            torch.zeros(B, Hkv, Nk, D, **f64),
            torch.zeros(B, Hkv, Nk, Dv, **f64),
        )
    lengths = None if seqlens_k is None else _as_torch(seqlens_k)
    slopes = None if alibi_slopes is None else _as_torch(alibi_slopes).expand(B, H)
    for b in range(B):
        for h in range(H):
            kv, one = h // group, (slice(b, b + 1), slice(h, h + 1))
            part = compute(
                q[one],
                k[b : b + 1, kv : kv + 1],
                v[b : b + 1, kv : kv + 1],
                None if do is None else _as_torch(do)[one],
                None if lengths is None else lengths[b : b + 1],
                None if stored_o is None else _as_torch(stored_o)[one],
                None if slopes is None else slopes[one],
            )
            result.o[b, h] = part.o[0, 0]
            result.lse[b, h] = part.lse[0, 0]
            if do is not None:
                result.dq[b, h] = part.dq[0, 0]
                result.dk[b, kv] += part.dk[0, 0].double()
                result.dv[b, kv] += part.dv[0, 0].double()
    return result


def reference_chunked(
    q,
    k,
    v,
    do=None,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k=None,
    stored_dtype=None,
    device: torch.device | str = "cuda",
    stored_o=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
) -> Result:
    """:func:`reference` computed one (batch, query head) at a time on ``device``: it holds the ``[Nq, Nk]`` float64
    matrices of one head only, so that it judges lengths whose whole score matrix would not fit (the GPU tests run
    it at N = 16k).  Same arguments and results as :func:`reference`."""

    def one_head(q1, k1, v1, do1, lengths, stored_o1, slopes1):
        return reference(
            q1, k1, v1, do1, causal, scale, lengths, stored_dtype, device, stored_o1,
            window=window, softcap=softcap, alibi_slopes=slopes1,
        )  # fmt: skip

    return _by_head(one_head, q, k, v, do, seqlens_k, stored_o, device, alibi_slopes)


def plain_torch_chunked(
    q,
    k,
    v,
    do=None,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
) -> Result:
    """:func:`plain_torch` computed one (batch, query head) at a time, on the inputs' device; the results are stored
    in float64 (each head's as plain PyTorch rounded it), dk and dv summed over the group in float64."""

    def one_head(q1, k1, v1, do1, lengths, _, slopes1):
        return plain_torch(q1, k1, v1, do1, causal, scale, lengths, window, softcap, slopes1)

    return _by_head(one_head, q, k, v, do, seqlens_k, None, _as_torch(q).device, alibi_slopes)


# -- SPEC.md's error rule -------------------------------------------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Rounding unit of each dtype.  The slack of the low-precision rule is one unit relative to the reference's
# largest magnitude (at least 1): the rounding of the stored output alone can cost half a unit where the
# baseline happened to round luckily.  lse is float32 in every dtype, so its slack is float32's.
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# Fixed tolerances for float32 and float64, relative to the same magnitude.  float32: sums of up to a few
# hundred products.  float64: lse is float64 too, so the reference backends are exact end to end, up to the
# rounding of sums of a few hundred float64 products (2^-52 * a few hundred, well below 1e-12).
FIXED_TOL = {
    torch.float32: {"o": 2e-5, "lse": 2e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4},
    torch.float64: {"o": 1e-12, "lse": 1e-12, "dq": 1e-12, "dk": 1e-12, "dv": 1e-12},
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


def bound(name: str, dtype: torch.dtype, magnitude: float, baseline_error: float, contract_error: float) -> float:
    """SPEC.md's rule from its ingredients.  float16/bfloat16: twice ``baseline_error`` (plain PyTorch's max
    error) plus one rounding unit of the stored output, plus twice ``contract_error``: how far the exact gradients
    move when Delta is computed from the stored ``o`` (see :func:`reference`'s ``stored_dtype``); float32/float64:
    a fixed tolerance plus twice ``contract_error``, plus twice ``baseline_error`` where a float32 baseline was taken
    (for an ill-conditioned call: a soft cap ``c`` multiplies a score's rounding error by ``1/c`` in the backward's
    ``1 - tanh^2(S / c)``, so a tiny cap makes float32 itself miss a fixed tolerance).  ``magnitude`` is
    ``max(1, max|ref|)``: tolerances and slack are relative to it."""
    if dtype in LOW_PRECISION:
        stored = torch.float32 if name == "lse" else dtype
        return 2.0 * baseline_error + EPS[stored] * magnitude + 2.0 * contract_error
    return FIXED_TOL[dtype][name] * magnitude + 2.0 * contract_error + 2.0 * baseline_error


def error_bound(
    name: str, ref: Tensor, baseline: Tensor | None, dtype: torch.dtype, contract_error: float = 0.0
) -> float:
    """:func:`bound` for output ``name`` with oracle result ``ref`` and :func:`plain_torch`'s ``baseline`` (needed
    for float16/bfloat16; for float32 only where the call is ill-conditioned, see :func:`bound`)."""
    magnitude = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    baseline_error = 0.0
    if baseline is not None and dtype != torch.float64 and ref.numel():
        baseline_error = float((baseline.double().to(ref.device) - ref).abs().max())
    return bound(name, dtype, magnitude, baseline_error, contract_error)


def check_output(name: str, got, ref: Tensor, baseline, dtype: torch.dtype, contract_error: float = 0.0) -> Check:
    """Compare output ``name`` ("o", "lse", "dq", "dk" or "dv") of a backend with the oracle's ``ref``.

    ``baseline`` is :func:`plain_torch`'s same output (needed for float16/bfloat16).  NaN anywhere fails;
    for ``lse`` the rows with no visible key must be exactly ``-inf`` and are left out of the error.
    """
    got = _as_torch(got).detach().to(ref.device).double()
    if got.shape != ref.shape:
        return Check(float("inf"), 0.0, f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    if torch.isnan(got).any():
        return Check(float("nan"), 0.0, f"NaN in {int(torch.isnan(got).sum())} elements")
    if baseline is not None:
        baseline = _as_torch(baseline).detach().to(ref.device).double()
    if name == "lse":
        no_key = torch.isneginf(ref)
        if not torch.equal(torch.isneginf(got), no_key):
            return Check(float("inf"), 0.0, "lse is not -inf exactly on the rows that see no key")
        ref, got = ref[~no_key], got[~no_key]
        baseline = None if baseline is None else baseline[~no_key]
    error = float((got - ref).abs().max()) if ref.numel() else 0.0
    bound = error_bound(name, ref, baseline, dtype, contract_error)
    message = "" if error <= bound else f"max error {error:.3e} > bound {bound:.3e}"
    return Check(error, bound, message)


def contract_errors(
    q,
    k,
    v,
    do,
    exact: Result,
    causal: bool = False,
    scale=None,
    seqlens_k=None,
    stored_o=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
    chunked: bool = False,
) -> dict[str, float]:
    """Per gradient, the max change of the exact result when Delta comes from the stored ``o`` (see
    :func:`reference`'s ``stored_dtype``): the backend's own ``o`` when ``stored_o`` is given (what its backward
    received), else the exact ``o`` correctly rounded.

    Any backend that follows the contract (forward returns ``o`` in the input dtype, backward receives it) carries
    this error in dq and dk.  It can exceed plain PyTorch's own error when dS = P (dP - Delta) is small against
    dP, e.g. with few keys per row, where it is pure cancellation.  Not needed for float64.  ``chunked``: computed
    with :func:`reference_chunked`, for an ``exact`` from it.
    """
    dtype = _as_torch(q).dtype
    if dtype == torch.float64:
        return {}
    compute = reference_chunked if chunked else reference
    stored = compute(
        q,
        k,
        v,
        do,
        causal,
        scale,
        seqlens_k,
        stored_dtype=dtype,
        device=exact.o.device,
        stored_o=stored_o,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    return {
        name: float((getattr(stored, name) - getattr(exact, name)).abs().max()) if exact.dq.numel() else 0.0
        for name in ("dq", "dk")
    }
