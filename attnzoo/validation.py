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


Window = tuple[int | None, int | None]


@dataclass(frozen=True)
class Problem:
    """The validated arguments of one attention call: everything a backend reads besides q, k and v.

    ``q`` is ``[batch, heads, seqlen_q, head_dim]``; ``k`` is ``[batch, kv_heads, seqlen_k, head_dim]`` and ``v``
    ``[batch, kv_heads, seqlen_k, head_dim_v]``.  ``dtype`` is a ``torch.dtype`` also for NumPy inputs (``is_numpy``
    tells them apart).

    Score modifiers (SPEC.md): ``window`` is ``(left, right)`` or None (no window; ``(None, None)`` becomes None),
    each side an int or None (unbounded), clamped to ``[-(Nq + Nk), Nq + Nk]``, which leaves the mask unchanged
    and keeps both sides within int32; ``softcap`` is 0.0 when off; ``alibi_slopes`` is the validated float32
    ``[H]`` or ``[B, H]`` tensor (or NumPy array) as given, or None; ``seqlens_k`` the integer ``[B]`` tensor as
    given, or None.  The two tensors take no part in equality or repr.
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
    head_dim_v: int = 0  # 0: as head_dim (validate_forward always sets it)
    window: Window | None = None
    softcap: float = 0.0
    seqlens_k: Any = field(default=None, compare=False, repr=False)
    alibi_slopes: Any = field(default=None, compare=False, repr=False)
    # A packed variable-length call (``attnzoo.attention_varlen``, validated by ``attnzoo.varlen``): int32 ``[B + 1]``
    # offsets of each sequence's rows; ``seqlen_q``/``seqlen_k`` are then the longest sequence's (or their hints).
    cu_seqlens_q: Any = field(default=None, compare=False, repr=False)
    cu_seqlens_k: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for multi-head, ``heads`` for multi-query attention)."""
        return self.heads // self.kv_heads

    @property
    def has_seqlens_k(self) -> bool:
        return self.seqlens_k is not None

    @property
    def has_alibi(self) -> bool:
        return self.alibi_slopes is not None

    @property
    def is_varlen(self) -> bool:
        """A packed variable-length call: q ``[total_q, H, D]``, k/v ``[total_k, Hkv, D]`` and ``cu_seqlens_*``."""
        return self.cu_seqlens_q is not None

    @property
    def features_used(self) -> frozenset[str]:
        """The SPEC.md features this call needs beyond plain attention (names as in ``Capabilities.features``)."""
        used = {
            "causal": self.causal,
            "seqlens_k": self.has_seqlens_k,
            "gqa": self.kv_heads != self.heads,
            "nq_ne_nk": self.seqlen_q != self.seqlen_k,
            "window": self.window is not None,
            "softcap": self.softcap != 0.0,
            "alibi": self.has_alibi,
            "head_dim_v": self.head_dim_v != self.head_dim,
            "varlen": self.is_varlen,
        }
        return frozenset(name for name, on in used.items() if on)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"torch.Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray(shape={x.shape}, dtype={x.dtype})"
    return f"{type(x).__name__}"


def _torch_dtype_of(name: str, x: Any, fp8: bool = False) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        if fp8:
            if x.dtype != torch.float8_e4m3fn:
                raise TypeError(f"{name} must have dtype torch.float8_e4m3fn, got {x.dtype}")
        elif x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}")
        return x.dtype
    if fp8:
        raise TypeError(f"{name} must be a torch tensor of dtype torch.float8_e4m3fn, got numpy {x.dtype}")
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
    window: Any = None,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    *,
    allow_numpy: bool = False,
    check_values: bool = True,
    fp8: bool = False,
) -> Problem:
    """Check the arguments of ``forward`` (and of ``attention``) and return the problem they describe.  ``fp8``:
    q, k and v must be ``torch.float8_e4m3fn`` instead (``attnzoo.attention_fp8``).

    Raises ``TypeError`` for a wrong kind or dtype and ``ValueError`` for a wrong shape or value.
    ``check_values=False`` leaves out the one check that reads tensor values (the range of ``seqlens_k``), which
    would synchronise with the GPU: the custom operators, which run inside compiled graphs, check shapes only.

    A plain call (``_plain_call_key``) that repeats one seen before returns the same ``Problem`` without the checks.
    """
    key = _plain_call_key(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes, allow_numpy, fp8)
    problem = _PLAIN_PROBLEMS.get(key) if key is not None else None
    if problem is None:
        problem = _validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes, allow_numpy,
                                    check_values, fp8)  # fmt: skip
        if key is not None:
            if len(_PLAIN_PROBLEMS) >= _PLAIN_PROBLEMS_MAX:
                _PLAIN_PROBLEMS.clear()
            _PLAIN_PROBLEMS[key] = problem
    return problem


# Validated plain calls: a training loop repeats the same shapes and arguments, and their checks cost host time on
# every call (about 11 us on an H200 machine's host, a tenth of a small forward's; docs/design.md, "Host time").
_PLAIN_PROBLEMS: dict[tuple, Problem] = {}
_PLAIN_PROBLEMS_MAX = 256


def _plain_call_key(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, seqlens_k: Any, window: Any, softcap: Any, alibi_slopes: Any,
    allow_numpy: bool, fp8: bool,
) -> tuple | None:  # fmt: skip
    """The key under which a call's ``Problem`` is remembered, or None for a call that is always checked afresh.

    Plain: q, k, v of type ``torch.Tensor`` itself (no subclass: fake and functional tensors are checked every time),
    no ``seqlens_k`` or ``alibi_slopes`` (their values and tensors are part of the check), and the other arguments
    of exactly the types bool, float (or None) and a tuple of ints or None.  For such a call every check reads only
    what the key holds: the tensors' shapes, dtypes, devices and layouts, and the arguments' values.  The exact types
    matter because equal values of other types pass or fail differently (``causal=1`` equals ``True`` and fails).
    """
    if seqlens_k is not None or alibi_slopes is not None:
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if type(causal) is not bool or type(softcap) is not float or not (scale is None or type(scale) is float):
        return None
    if window is not None and not (
        type(window) is tuple and len(window) == 2 and all(w is None or type(w) is int for w in window)
    ):
        return None
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.layout, k.layout,
        v.layout, causal, scale, window, softcap, allow_numpy, fp8,
    )  # fmt: skip


def _validate_forward(
    q: Any,
    k: Any,
    v: Any,
    causal: Any,
    scale: Any,
    seqlens_k: Any,
    window: Any,
    softcap: Any,
    alibi_slopes: Any,
    allow_numpy: bool,
    check_values: bool,
    fp8: bool,
) -> Problem:
    """``validate_forward``'s checks, every time."""
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
    dtypes = {name: _torch_dtype_of(name, x, fp8) for name, x in (("q", q), ("k", k), ("v", v))}
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
    Dv = int(v.shape[3])
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(
            f"k and v must have the same [B, Hkv, Nk] (v may have its own head dim), got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    if Bk != B:
        raise ValueError(f"k must have batch size {B} (as q), got {Bk}")
    if Dk != D:
        raise ValueError(f"k must have head dim {D} (as q), got {Dk}")
    if D < 1:
        raise ValueError(f"q must have head dim D >= 1, got {D}")
    if Dv < 1:
        raise ValueError(f"v must have head dim Dv >= 1, got {Dv}")
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
    window = _validate_window(window, Nq, Nk)
    softcap = _validate_softcap(softcap)
    if alibi_slopes is not None:
        _validate_alibi_slopes(alibi_slopes, B, H, q, is_numpy)
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
        head_dim_v=Dv,
        window=window,
        softcap=softcap,
        seqlens_k=seqlens_k,
        alibi_slopes=alibi_slopes,
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _validate_window(window: Any, Nq: int, Nk: int) -> Window | None:
    """``(left, right)`` of ints or None, clamped to ``[-(Nq + Nk), Nq + Nk]``; None when both sides are unbounded.

    Row ``i`` sees key ``j`` iff ``-left <= j - i' <= right``, and ``j - i'`` lies in ``[-(Nk - 1), Nq - 1]``: a side
    beyond ``Nq + Nk`` either way selects the same keys as ``Nq + Nk`` does, so clamping changes no mask.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(w is None or _is_int(w) for w in window):
        raise TypeError(f"window must be None or a pair (left, right) of ints or None, got {window!r}")
    if window[0] is None and window[1] is None:
        return None
    bound = Nq + Nk
    left, right = (None if w is None else max(-bound, min(bound, int(w))) for w in window)
    return left, right


def _validate_softcap(softcap: Any) -> float:
    """0.0 (off) or a positive float within float32's normal range (kernels divide the scores by it in float32)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap must be a real number (0.0: off), got {type(softcap).__name__} {softcap!r}")
    try:
        value = float(softcap)
    except OverflowError:
        value = math.inf
    finfo = np.finfo(np.float32)
    if value != 0.0 and not (float(finfo.tiny) <= value <= float(finfo.max)):
        raise ValueError(
            f"softcap must be 0 (off) or positive, finite and within float32's normal range, got {softcap!r}"
        )
    return value


def _validate_alibi_slopes(slopes: Any, B: int, H: int, q: Any, is_numpy: bool) -> None:
    """float32 ``[H]`` or ``[B, H]``, on the device of q (a NumPy array with NumPy inputs)."""
    if is_numpy and isinstance(slopes, np.ndarray):
        dtype_ok = slopes.dtype == np.float32
    elif isinstance(slopes, torch.Tensor) and slopes.layout == torch.strided:
        dtype_ok = slopes.dtype == torch.float32
        if not is_numpy and slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on the device of q ({q.device}), got {slopes.device}")
    else:
        expected = "a float32 numpy array or torch tensor" if is_numpy else "a dense float32 torch.Tensor"
        raise TypeError(f"alibi_slopes must be None or {expected} of shape [H] or [B, H], got {_describe(slopes)}")
    if not dtype_ok:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape [H] = [{H}] or [B, H] = [{B}, {H}], got {tuple(slopes.shape)}")


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
    expected_q = (problem.batch, problem.heads, problem.seqlen_q, problem.head_dim_v)
    for name, x in (("do", do), ("o", o)):
        _check_array(name, x, allow_numpy)
        if (type(x) is np.ndarray) != problem.is_numpy:
            raise TypeError(f"{name} must be of the same kind as q, got {_describe(x)}")
        if tuple(x.shape) != expected_q:
            raise ValueError(
                f"{name} must have shape [B, H, Nq, Dv] (q's, with v's head dim) = {list(expected_q)}, "
                f"got {list(x.shape)}"
            )
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
