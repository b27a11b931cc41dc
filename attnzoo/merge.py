"""``attnzoo.merge_attention``: the union of attention results over disjoint key sets, from their (o, lse).

Attention over a key set ``K = K_1 ∪ ... ∪ K_P`` (disjoint) decomposes by the log-sum-exp: with
``lse_p = log Σ_{j ∈ K_p} exp(S_j)`` and ``o_p = Σ_{j ∈ K_p} exp(S_j - lse_p) v_j``,

    lse = log Σ_p exp(lse_p)            o = Σ_p exp(lse_p - lse) · o_p

which is how split-K decoding (one part per key range), cascade attention (a shared prefix and a private suffix) and
ring attention (one part per ring step) put their pieces together.  The sum is taken relative to the largest
``lse_p`` so that no ``exp`` overflows; a part with no visible key (``lse_p = -inf``, ``o_p = 0``) weighs nothing,
and a row with no visible key in any part keeps ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def _stacked(name: str, parts: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(parts, Tensor):
        return parts
    if isinstance(parts, (list, tuple)) and parts and all(isinstance(p, Tensor) for p in parts):
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: every part must have the same shape, got {sorted(shapes)}")
        return torch.stack(list(parts))
    raise TypeError(f"{name} must be a tensor [P, ...] or a non-empty list of tensors, got {type(parts).__name__}")


def merge_attention(o_parts: Tensor | Sequence[Tensor], lse_parts: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge ``P`` partial attention results over disjoint key sets into the result over their union.

    o_parts: ``[P, ..., Dv]`` (any float dtype), lse_parts: ``[P, ...]`` (float32 or float64), the ``...`` dims equal
    (e.g. ``[P, B, H, Nq, Dv]`` and ``[P, B, H, Nq]``); a list of ``P`` tensors is stacked.  Returns ``o`` ``[..., Dv]``
    in the dtype of ``o_parts`` and ``lse`` ``[...]`` in the dtype of ``lse_parts``; the sums run in float32 (float64
    when either is float64).  Differentiable in both arguments; works under ``torch.compile``.
    """
    o_parts = _stacked("o_parts", o_parts)
    lse_parts = _stacked("lse_parts", lse_parts)
    if not o_parts.is_floating_point():
        raise TypeError(f"o_parts must be a floating-point tensor, got {o_parts.dtype}")
    if lse_parts.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"lse_parts must be float32 or float64, got {lse_parts.dtype}")
    if o_parts.device != lse_parts.device:
        raise ValueError(f"o_parts is on {o_parts.device} but lse_parts is on {lse_parts.device}")
    if o_parts.dim() < 2 or tuple(o_parts.shape[:-1]) != tuple(lse_parts.shape):
        raise ValueError(
            f"o_parts [P, ..., Dv] and lse_parts [P, ...] must agree on [P, ...]: got o_parts {tuple(o_parts.shape)} "
            f"and lse_parts {tuple(lse_parts.shape)}"
        )
    if o_parts.shape[0] == 0:
        raise ValueError("o_parts: at least one part is needed (P >= 1), got P = 0")

    lse_dtype = lse_parts.dtype
    acc = torch.float64 if torch.float64 in (o_parts.dtype, lse_dtype) else torch.float32
    lse_parts = lse_parts.to(acc)
    # The largest part's lse as the reference; a row empty in every part has max -inf, replaced by 0 so that
    # lse_p - max stays -inf (weight 0) instead of -inf - -inf = NaN.
    lse_max = lse_parts.amax(dim=0)
    lse_ref = torch.where(lse_max == float("-inf"), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse_parts - lse_ref)  # [P, ...]; 0 for empty parts, 1 for the largest
    total = weights.sum(dim=0)
    lse = lse_ref + torch.log(total)  # log 0 = -inf for rows with no visible key anywhere
    # Normalised weights; an empty row has total 0 and keeps o = 0 (not 0/0).
    share = weights / torch.where(total == 0, torch.ones_like(total), total)
    # An empty part's o is 0 by contract; where its weight is 0 it is left out of the sum entirely, so that a part
    # which saw no key contributes nothing even if its o holds garbage.  NaN in a weighted part still propagates.
    contributions = torch.where((share != 0).unsqueeze(-1), share.unsqueeze(-1) * o_parts.to(acc), 0.0)
    o = contributions.sum(dim=0)
    return o.to(o_parts.dtype), lse.to(lse_dtype)
