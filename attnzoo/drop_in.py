"""``attnzoo.sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with its exact signature and semantics,
run by an attnzoo backend whenever the call is expressible in attnzoo's contract, and by torch's own SDPA otherwise.

Expressible calls: 4-d floating ``[B, H, Nq, D]`` / ``[B, Hkv, Nk, D]`` tensors on one device, no dropout
(``dropout_p == 0``), grouped-query heads only with ``enable_gqa=True`` (as torch), and a mask that attnzoo has:

- ``is_causal=True`` is SDPA's *top-left* causal mask (row ``i`` sees keys ``j <= i``).  attnzoo's ``causal`` is
  bottom-right aligned; the two agree when ``Nq == Nk``, and otherwise top-left causal is the window
  ``(None, Nq - Nk)`` (row ``i`` sees ``j <= i' + Nq - Nk = i``).
- ``attn_mask`` as a key-padding mask: boolean (True = attend) or additive (0 = attend, ``-inf`` = hidden), of a shape
  that broadcasts to ``[B, H, Nq, Nk]`` with size 1 along heads and queries, whose visible keys of each batch are a
  prefix ``0 .. seqlens_k[b] - 1``.  Recognising it reads the mask's values, so it is done in eager mode only;
  inside ``torch.compile`` every ``attn_mask`` goes to torch's SDPA.

Everything else (dropout, arbitrary masks, other ranks) is passed to torch's SDPA unchanged, which also raises
torch's own errors for calls torch rejects.  A row with no visible key gives 0 here, where torch's SDPA may give NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .autograd import attention
from .backend import Backend

Tensor = torch.Tensor

# torch's own function, captured before anything can patch it, so that the fallback never calls attnzoo again.
_torch_sdpa = F.scaled_dot_product_attention
_backend: contextvars.ContextVar[str | Backend] = contextvars.ContextVar("attnzoo_sdpa_backend", default="auto")


def _key_lengths(attn_mask: Tensor, batch: int, seqlen_k: int) -> Tensor | None:
    """``seqlens_k`` ``[B]`` int32 if ``attn_mask`` is a prefix key-padding mask, else None (reads its values)."""
    if attn_mask.dim() > 4 or attn_mask.shape[-1] != seqlen_k:
        return None
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, batch):
        return None
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        finite = torch.isfinite(mask)
        if not bool(((mask == 0) | (torch.isneginf(mask))).all()):
            return None
        visible = finite
    else:
        return None
    visible = visible.reshape(mask.shape[0], seqlen_k)
    lengths = visible.sum(dim=-1, dtype=torch.int32)
    prefix = torch.arange(seqlen_k, device=visible.device) < lengths[:, None]
    if not bool((prefix == visible).all()):
        return None
    return lengths.expand(batch).contiguous()


def _attnzoo_arguments(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> dict | None:
    """The arguments of :func:`attnzoo.attention` that compute this SDPA call, or None when it is not expressible."""
    tensors = (query, key, value)
    if not all(isinstance(x, Tensor) and x.dim() == 4 and x.is_floating_point() for x in tensors):
        return None
    if dropout_p != 0.0 or len({x.dtype for x in tensors}) > 1 or len({x.device for x in tensors}) > 1:
        return None
    batch, heads, seqlen_q, _ = query.shape
    kv_heads, seqlen_k = key.shape[1], key.shape[2]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[-1] != query.shape[-1]:
        return None  # torch's SDPA says what is wrong
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return None
    seqlens_k = None
    if attn_mask is not None:
        if is_causal or not isinstance(attn_mask, Tensor) or torch.compiler.is_compiling():
            return None
        seqlens_k = _key_lengths(attn_mask, batch, seqlen_k)
        if seqlens_k is None:
            return None
    if is_causal and seqlen_q != seqlen_k:
        return dict(window=(None, seqlen_q - seqlen_k), seqlens_k=seqlens_k)  # top-left, not attnzoo's bottom-right
    return dict(causal=bool(is_causal), seqlens_k=seqlens_k)


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by attnzoo where expressible (module docstring).

    query: ``[B, H, Nq, D]``; key: ``[B, Hkv, Nk, D]``; value: ``[B, Hkv, Nk, Dv]``.  Returns ``[B, H, Nq, Dv]``,
    with autograd.  The backend
    is ``"auto"``, or the one given to :func:`sdpa_patched`.
    """
    arguments = _attnzoo_arguments(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if arguments is None:
        return _torch_sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip
    return attention(query, key, value, scale=scale, backend=_backend.get(), **arguments)


@contextlib.contextmanager
def sdpa_patched(backend: str | Backend = "auto") -> Iterator[None]:
    """Inside the block, ``torch.nn.functional.scaled_dot_product_attention`` is :func:`sdpa` running ``backend``.

    Code that looks the function up at call time (``F.scaled_dot_product_attention(...)``, as ``torch.nn`` modules and
    most models do) is redirected; a name imported before the block (``from torch.nn.functional import ...``) is not.
    """
    if not isinstance(backend, (str, Backend)):
        raise TypeError(f"backend must be a backend name, a Backend or 'auto', got {type(backend).__name__}")
    token = _backend.set(backend)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
        _backend.reset(token)
