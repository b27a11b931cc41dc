"""FP8 (e4m3) attention forward: ``attnzoo.attention_fp8``.

q, k and v arrive as ``torch.float8_e4m3fn`` with descale factors, FlashAttention-3's convention: the real inputs
are ``q_descale * q`` and so on, per tensor (a 0-d factor) or per (batch, K/V head) (``[B, Hkv]``; the query heads of
a group share their K/V head's factor).  The result is the attention of those real inputs, o in bfloat16.

The Triton kernels run the product ``S = q k^T`` on the FP8 values (the tensor cores' FP8 path, twice the 16-bit
rate on Hopper), multiply the scores by ``scale * q_descale * k_descale``, round P to e4m3 for ``P V`` and multiply
o by ``v_descale`` (``kernels/forward.py``, DESCALE).  The other backends compute the real inputs in float32 and run
their float32 forward: the zoo's reference for the FP8 path.

Accuracy (tests/test_fp8.py): SPEC.md's rule for 16-bit outputs, with plain PyTorch's FP8 recipe as its baseline:
:func:`fp8_recipe` computes ``q k^T`` and ``P V`` as PyTorch's FP8 products (``torch._scaled_mm``: on a GPU with the
tensor cores' fast accumulation, as the kernels' products accumulate) and the softmax in float32, rounds P to e4m3
before ``P V`` and o to bfloat16.  A backend's error against the float64 oracle of the real inputs is at most twice
the recipe's, plus one bfloat16 rounding unit of o.  Plain bfloat16 attention of the real inputs would be no
baseline: it rounds S to bfloat16, whose error grows with the scores, while e4m3's P costs about the same at any
scale.  On random inputs (D = 64, N = 128, two draws each) the recipe's o error was 7.4-8.9x bfloat16 attention's at
|x| ~ 0.5, 1.6-2.1x at |x| ~ 1 and 0.57-0.60x at |x| ~ 3, so a rule on bfloat16 would fail correct FP8 kernels on
small inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from .backend import Backend, get
from .validation import Problem, validate_forward

FP8 = torch.float8_e4m3fn


def _check_descale(name: str, x: Any, batch: int, kv_heads: int, device: torch.device) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor or None, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if tuple(x.shape) not in ((), (batch, kv_heads)):
        raise ValueError(f"{name} must have shape [] or [B, Hkv] = [{batch}, {kv_heads}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")


def descale_table(
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    batch: int,
    kv_heads: int,
    device: torch.device,
) -> torch.Tensor:
    """The three factors per (batch, K/V head) -> float32 ``[B, Hkv, 3]`` contiguous (q, k, v; None: 1), detached
    (the FP8 forward has no autograd)."""
    parts = [
        torch.ones((), dtype=torch.float32, device=device) if x is None else x.detach()
        for x in (q_descale, k_descale, v_descale)
    ]
    return torch.stack([x.expand(batch, kv_heads) for x in parts], dim=-1).contiguous()


def dequantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype):
    """The real inputs in ``dtype``: ``q`` ``[B, H, Nq, D]`` times its (batch, K/V head) factor of ``descale``
    (``[B, Hkv, 3]``), k and v likewise."""
    group = q.shape[1] // k.shape[1]
    q_factor = descale[..., 0].repeat_interleave(group, dim=1)[:, :, None, None]
    return (
        q.to(dtype) * q_factor.to(dtype),
        k.to(dtype) * descale[..., 1, None, None].to(dtype),
        v.to(dtype) * descale[..., 2, None, None].to(dtype),
    )


def _fp8_product(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``scale_a * scale_b * a @ b_rows^T`` of FP8 ``a`` ``[M, K]`` and ``b_rows`` ``[N, K]``, in float32, by
    ``torch._scaled_mm`` with fast accumulation: on a GPU the tensor cores' FP8 product, accumulated as the kernels'
    is.  M, N and K are padded with zeros to multiples of 16, which the product needs."""
    m, k, n = a.shape[0], a.shape[1], b_rows.shape[0]

    def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.zeros(-(-rows // 16) * 16, -(-k // 16) * 16, dtype=x.dtype, device=x.device)
        out[: x.shape[0], :k] = x
        return out

    # cuBLASLt refuses (NOT_SUPPORTED) a scale whose pointer is a view into a table: each factor gets its own,
    # aligned allocation.
    product = torch._scaled_mm(
        padded(a, m), padded(b_rows, n).t(), scale_a=scale_a.clone(), scale_b=scale_b.clone(), out_dtype=torch.float32,
        use_fast_accum=True,
    )  # fmt: skip
    return product[:m, :n]


def fp8_recipe(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch's FP8 attention, the baseline of the accuracy rule, head by head: ``S = q k^T`` and ``P V`` as
    FP8 products (:func:`_fp8_product`) with the factors as their scales, the softmax in float32, P (each row over
    its own max) rounded to e4m3 for ``P V``, o in bfloat16 -> ``(o, lse)``."""
    batch, heads, nq, _ = q.shape
    group = heads // k.shape[1]
    nk = k.shape[2]
    o = torch.empty(batch, heads, nq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, nq, dtype=torch.float32, device=q.device)
    one = torch.ones((), dtype=torch.float32, device=q.device)
    hidden = None
    if causal:  # bottom-right aligned, as SPEC.md's causal mask
        rows = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        hidden = torch.arange(nk, device=q.device)[None, :] > rows
    for b in range(batch):
        for h in range(heads):
            factors = descale[b, h // group]
            s = _fp8_product(q[b, h], k[b, h // group], factors[0], factors[1]) * scale
            if hidden is not None:
                s = s.masked_fill(hidden, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            p = torch.exp(s - m)
            lsum = p.sum(-1, keepdim=True)
            pv = _fp8_product(p.to(FP8), v[b, h // group].t().contiguous(), one, factors[2])
            o[b, h] = pv / torch.where(lsum == 0, torch.ones_like(lsum), lsum)
            lse[b, h] = torch.where(lsum == 0, float("-inf"), m + torch.log(lsum)).squeeze(-1)
    return o.to(torch.bfloat16), lse


def fp8_backend(backend: str | Backend, device: torch.device) -> Backend:
    """``backend`` as a Backend; "auto": ``triton_2kernel`` where q is on an NVIDIA GPU with FP8 tensor cores
    (compute capability 8.9 and later) and Triton imports, ``torch_fa2`` otherwise (the real inputs in float32)."""
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name or a Backend, got {type(backend).__name__}")
    if backend != "auto":
        return get(backend)
    import importlib.util

    fast = (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (8, 9)
        and importlib.util.find_spec("triton") is not None
    )
    return get("triton_2kernel" if fast else "torch_fa2")


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: str | Backend = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of FP8 inputs (forward only, no autograd).

    q: ``[B, H, Nq, D]``, k: ``[B, Hkv, Nk, D]``, v: ``[B, Hkv, Nk, Dv]``, all ``torch.float8_e4m3fn``;
    ``q_descale``/``k_descale``/``v_descale``: float32 ``[]`` or ``[B, Hkv]`` on q's device, or None (1).  The real
    inputs are ``descale * x``; ``causal`` is bottom-right aligned and ``scale`` defaults to ``1/sqrt(D)``, as in
    ``attention``.  Returns o ``[B, H, Nq, Dv]`` bfloat16, and with ``return_lse`` also lse ``[B, H, Nq]`` float32.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    problem = validate_forward(q, k, v, causal, scale, fp8=True)
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _check_descale(name, x, problem.batch, problem.kv_heads, q.device)
    chosen = fp8_backend(backend, q.device)
    descale = descale_table(q_descale, k_descale, v_descale, problem.batch, problem.kv_heads, q.device)
    o, lse = chosen.forward_fp8(q, k, v, descale, problem)
    return (o, lse) if return_lse else o


def forward_dequantized(backend: Backend, q, k, v, descale: torch.Tensor, problem: Problem):
    """A backend's FP8 forward through its float32 forward on the real inputs (``Backend.forward_fp8``'s default)."""
    import dataclasses

    real = dequantize(q, k, v, descale, torch.float32)
    o, lse = backend.forward_validated(*real, dataclasses.replace(problem, dtype=torch.float32))
    return o.to(torch.bfloat16), lse
