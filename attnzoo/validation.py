"""Input validation shared by every backend.

Every public call goes through :func:`validate_forward` (and :func:`validate_backward` for the backward)
before any kernel starts, so that bad input is rejected the same way by every backend, with a message
that names the argument, the expected and the actual value.  Nothing here modifies an input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_TORCH_INT_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
_NUMPY_FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16))


@dataclass(frozen=True)
class Problem:
    """The validated shape of one attention call.

    ``q`` is ``[batch, heads, seqlen_q, head_dim]``; ``k`` and ``v`` are ``[batch, kv_heads, seqlen_k, head_dim]``.
    ``dtype`` is a ``torch.dtype`` also for NumPy inputs (``is_numpy`` tells them apart).
    Every argument of the call besides the tensors travels here, so a backend reads one object: ``seqlens_k`` is the
    validated integer tensor (or array) ``[batch]`` itself, or None.
    """

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    device: str  # the device type: "cpu" or "cuda"
    causal: bool
    scale: float
    is_numpy: bool
    device_name: str = "cpu"  # the full device, e.g. "cuda:1"
    seqlens_k: Any = field(default=None, compare=False, repr=False)

    @property
    def has_seqlens_k(self) -> bool:
        """Whether keys are masked per batch (``seqlens_k`` given)."""
        return self.seqlens_k is not None

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for multi-head, ``heads`` for multi-query attention)."""
        return self.heads // self.kv_heads


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"torch.Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray(shape={x.shape}, dtype={x.dtype})"
    return f"{type(x).__name__}"


def _torch_dtype_of(name: str, x: Any) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}")
        return x.dtype
    if x.dtype not in _NUMPY_FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64), got numpy {x.dtype}")
    return {np.float64: torch.float64, np.float32: torch.float32, np.float16: torch.float16}[x.dtype.type]


def _check_array(name: str, x: Any, allow_numpy: bool) -> None:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
        return
    if isinstance(x, np.ndarray):
        if allow_numpy:
            return
        raise TypeError(f"{name} must be a torch.Tensor (this backend takes no numpy arrays), got {_describe(x)}")
    expected = "a torch.Tensor or numpy.ndarray" if allow_numpy else "a torch.Tensor"
    raise TypeError(f"{name} must be {expected}, got {_describe(x)}")


def _device_type(x: Any) -> str:
    return x.device.type if isinstance(x, torch.Tensor) else "cpu"


def _device_of(x: Any) -> str:
    return str(x.device) if isinstance(x, torch.Tensor) else "cpu (numpy)"


def validate_forward(
    q: Any,
    k: Any,
    v: Any,
    causal: Any = False,
    scale: Any = None,
    seqlens_k: Any = None,
    *,
    allow_numpy: bool = False,
    check_values: bool = True,
) -> Problem:
    """Check the arguments of ``forward`` (and of ``attention``) and return the problem they describe.

    Raises ``TypeError`` for a wrong kind or dtype and ``ValueError`` for a wrong shape or value.
    ``check_values=False`` leaves out the one check that reads tensor values (the range of ``seqlens_k``), which
    would synchronise with the GPU: the custom operators, which run inside compiled graphs, check shapes only.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, allow_numpy)
    kinds = {type(x) is np.ndarray for x in (q, k, v)}
    if len(kinds) > 1:
        raise TypeError(
            f"q, k and v must all be torch tensors or all numpy arrays, got "
            f"q={_describe(q)}, k={_describe(k)}, v={_describe(v)}"
        )
    is_numpy = isinstance(q, np.ndarray)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            layout = "[B, H, Nq, D]" if name == "q" else "[B, Hkv, Nk, D]"
            raise ValueError(f"{name} must have rank 4, {layout}, got rank {x.ndim} with shape {tuple(x.shape)}")
    dtypes = {name: _torch_dtype_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, k and v must have the same dtype, got q={dtypes['q']}, k={dtypes['k']}, v={dtypes['v']}")
    devices = {_device_of(x) for x in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(
            f"q, k and v must be on the same device, got q on {_device_of(q)}, k on {_device_of(k)}, "
            f"v on {_device_of(v)}"
        )
    B, H, Nq, D = (int(s) for s in q.shape)
    Bk, Hkv, Nk, Dk = (int(s) for s in k.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"k must have batch size {B} (as q), got {Bk}")
    if Dk != D:
        raise ValueError(f"k and v must have head dim {D} (as q), got {Dk}")
    if D < 1:
        raise ValueError(f"q must have head dim D >= 1, got {D}")
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of K/V heads, got H={H} (q) and "
            f"Hkv={Hkv} (k, v)"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    else:
        try:
            value = float(scale)
        except OverflowError:
            value = math.inf
        # Kernels multiply in float32: a scale beyond its range would turn every score into inf/NaN.
        if not math.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
            raise ValueError(f"scale must be finite in float32, got {scale!r}")
    if seqlens_k is not None:
        _validate_seqlens_k(seqlens_k, B, Nk, q, is_numpy, check_values)
    return Problem(
        batch=B,
        heads=H,
        kv_heads=Hkv,
        seqlen_q=Nq,
        seqlen_k=Nk,
        head_dim=D,
        dtype=dtypes["q"],
        device=_device_type(q),
        causal=bool(causal),
        scale=float(scale),
        is_numpy=is_numpy,
        device_name=_device_of(q),
        seqlens_k=seqlens_k,
    )


def _validate_seqlens_k(seqlens_k: Any, B: int, Nk: int, q: Any, is_numpy: bool, check_values: bool) -> None:
    if is_numpy and isinstance(seqlens_k, np.ndarray):
        if seqlens_k.dtype.kind not in "iu":
            raise TypeError(f"seqlens_k must have an integer dtype, got numpy {seqlens_k.dtype}")
        values = seqlens_k
    elif isinstance(seqlens_k, torch.Tensor):
        if seqlens_k.dtype not in _TORCH_INT_DTYPES or seqlens_k.layout != torch.strided:
            raise TypeError(
                f"seqlens_k must be a dense tensor of an integer dtype (e.g. torch.int32), got {seqlens_k.dtype} "
                f"({seqlens_k.layout})"
            )
        if not is_numpy and seqlens_k.device != q.device:
            raise ValueError(f"seqlens_k must be on the device of q ({q.device}), got {seqlens_k.device}")
        values = seqlens_k
    else:
        expected = "an integer numpy array or torch tensor" if is_numpy else "an integer torch.Tensor"
        raise TypeError(f"seqlens_k must be None or {expected} of shape [{B}], got {_describe(seqlens_k)}")
    if tuple(values.shape) != (B,):
        raise ValueError(f"seqlens_k must have shape [B] = [{B}], got {tuple(values.shape)}")
    if B > 0 and check_values:
        values = values.to(torch.int64) if isinstance(values, torch.Tensor) else values.astype(np.int64)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > Nk:
            raise ValueError(f"seqlens_k values must lie in [0, Nk] = [0, {Nk}], got min {low} and max {high}")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the forward's ``lse`` for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def validate_backward(problem: Problem, do: Any, o: Any, lse: Any) -> None:
    """Check the extra arguments of ``backward`` against the validated forward problem."""
    allow_numpy = problem.is_numpy
    expected_q = (problem.batch, problem.heads, problem.seqlen_q, problem.head_dim)
    for name, x in (("do", do), ("o", o)):
        _check_array(name, x, allow_numpy)
        if (type(x) is np.ndarray) != problem.is_numpy:
            raise TypeError(f"{name} must be of the same kind as q, got {_describe(x)}")
        if tuple(x.shape) != expected_q:
            raise ValueError(f"{name} must have the shape of q, {list(expected_q)}, got {list(x.shape)}")
        if _torch_dtype_of(name, x) != problem.dtype:
            raise TypeError(f"{name} must have the dtype of q ({problem.dtype}), got {x.dtype}")
        if _device_of(x) != problem.device_name:
            raise ValueError(f"{name} must be on the device of q ({problem.device_name}), got {_device_of(x)}")
    _check_array("lse", lse, allow_numpy)
    expected_lse = (problem.batch, problem.heads, problem.seqlen_q)
    if tuple(lse.shape) != expected_lse:
        raise ValueError(f"lse must have shape [B, H, Nq] = {list(expected_lse)}, got {list(lse.shape)}")
    # The forward's lse: float64 for float64 inputs (the reference backends are exact end to end), else float32.
    wide = problem.dtype == torch.float64
    expected = (np.float64 if wide else np.float32) if isinstance(lse, np.ndarray) else lse_dtype(problem.dtype)
    if lse.dtype != expected:
        raise TypeError(f"lse must be {'float64 for float64 inputs' if wide else 'float32'}, got {lse.dtype}")
    if _device_of(lse) != problem.device_name:
        raise ValueError(f"lse must be on the device of q ({problem.device_name}), got {_device_of(lse)}")
