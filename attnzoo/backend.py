"""The backend interface, each backend's declared capabilities, and the registry.

A backend declares what it supports in one :class:`Capabilities` object.  Support questions
(:meth:`Backend.not_supported_reasons`), ``backend="auto"``, the README's backend table and the
property tests all read that one declaration.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._env import (  # noqa: F401  (re-exported for backends)
    interpreter_unusable_reason,
    new_output,
    poison_outputs,
    triton_interpreter_active,
)
from .validation import Problem, lse_dtype, validate_backward, validate_forward

Tensor = torch.Tensor

# Features of SPEC.md that every backend must support; the property tests check the declarations against it.
# The last four are SPEC.md's score modifiers and a value head dim of its own (issue 25).
SCORE_MODIFIER_FEATURES = frozenset({"window", "softcap", "alibi", "head_dim_v"})
# "varlen": packed variable-length batches (attnzoo.attention_varlen, issue 26).
REQUIRED_FEATURES = frozenset({"causal", "seqlens_k", "gqa", "nq_ne_nk", "strided", "varlen"}) | SCORE_MODIFIER_FEATURES

# What a backend that does not declare a feature says in ``not_supported_reasons`` when a call uses it.
FEATURE_NAMES = {
    "causal": "causal masking",
    "seqlens_k": "seqlens_k (key padding)",
    "gqa": "grouped-query heads (Hkv < H)",
    "nq_ne_nk": "Nq != Nk",
    "window": "window (sliding-window attention)",
    "softcap": "softcap (logit soft-capping)",
    "alibi": "alibi_slopes (ALiBi)",
    "head_dim_v": "a value head dim Dv != D",
    "varlen": "packed variable-length batches (cu_seqlens)",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared once.

    ``auto_rank`` orders the backends that ``attention(..., backend="auto")`` may pick on each device
    type (lower is preferred); a device type absent from it is never picked automatically.
    ``features`` names the SPEC.md features the backend implements (``REQUIRED_FEATURES`` by default); a call
    that uses one it lacks is declared unsupported, with the feature named.  ``extra_reasons`` adds
    backend-specific checks that the generic fields cannot express.  ``kvcache``: the backend answers
    ``attnzoo.attention_with_kvcache`` (:meth:`Backend.kvcache_forward`), which ``kvcache_auto_rank`` orders for
    ``backend="auto"`` as ``auto_rank`` does for ``attention``.
    """

    summary: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int | None = None
    features: frozenset[str] = REQUIRED_FEATURES
    accepts_numpy: bool = False
    deterministic: bool = True
    auto_rank: Mapping[str, int] = field(default_factory=dict)
    extra_reasons: Callable[[Problem], list[str]] | None = None
    kvcache: bool = False
    kvcache_auto_rank: Mapping[str, int] = field(default_factory=dict)


class Backend:
    """One implementation of exact attention (see SPEC.md for the contract).

    Subclasses set ``name`` and ``capabilities`` and implement ``_forward`` and ``_backward`` on
    validated, supported inputs.
    """

    name: str = ""
    capabilities: Capabilities

    # -- support -------------------------------------------------------------------------------------
    def reasons_for(self, problem: Problem) -> list[str]:
        """Why this backend cannot run ``problem`` ([] when it can)."""
        caps = self.capabilities
        reasons = []
        if problem.device not in caps.devices:
            reasons.append(f"device {problem.device} not supported (supports {', '.join(sorted(caps.devices))})")
        if problem.dtype not in caps.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in caps.dtypes))
            reasons.append(f"dtype {str(problem.dtype).removeprefix('torch.')} not supported (supports {names})")
        if caps.max_head_dim is not None and max(problem.head_dim, problem.head_dim_v) > caps.max_head_dim:
            reasons.append(f"head dim {max(problem.head_dim, problem.head_dim_v)} above the limit {caps.max_head_dim}")
        for feature in sorted(problem.features_used - caps.features):
            reasons.append(f"{FEATURE_NAMES.get(feature, feature)} not supported")
        if caps.extra_reasons is not None:
            reasons.extend(caps.extra_reasons(problem))
        return reasons

    def not_supported_reasons(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: bool = False,
        scale: float | None = None,
        seqlens_k: Any = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float = 0.0,
        alibi_slopes: Any = None,
    ) -> list[str]:
        """Validate the inputs and return why this backend cannot run them ([] when it can).

        Bad input, a head dim above the backend's limit included, raises as in ``forward``.
        """
        problem = self._validate(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes)
        self._check_head_dim(problem)
        return self.reasons_for(problem)

    def _validate(self, q, k, v, causal, scale, seqlens_k, window=None, softcap=0.0, alibi_slopes=None) -> Problem:
        return validate_forward(
            q,
            k,
            v,
            causal,
            scale,
            seqlens_k,
            window,
            softcap,
            alibi_slopes,
            allow_numpy=self.capabilities.accepts_numpy,
        )

    def _check_head_dim(self, problem: Problem) -> None:
        limit = self.capabilities.max_head_dim
        if limit is not None and problem.head_dim > limit:
            raise ValueError(
                f"q has head dim D={problem.head_dim}, above the limit of backend {self.name!r} (D <= {limit})"
            )
        if limit is not None and problem.head_dim_v > limit:
            raise ValueError(
                f"v has head dim Dv={problem.head_dim_v}, above the limit of backend {self.name!r} (Dv <= {limit})"
            )

    def _check(self, problem: Problem) -> None:
        # A problem without tensor arguments (which take no part in a Problem's equality, and which the set would keep
        # alive) that this backend ran before passes again: its reasons follow from the problem's fields.
        remembered = problem.seqlens_k is None and problem.alibi_slopes is None and problem.cu_seqlens_q is None
        if remembered and (self, problem) in _SUPPORTED:
            return
        self._check_head_dim(problem)
        reasons = self.reasons_for(problem)
        if reasons:
            raise NotImplementedError(f"backend {self.name!r} does not support this input: " + "; ".join(reasons))
        if remembered:
            if len(_SUPPORTED) >= 256:
                _SUPPORTED.clear()
            _SUPPORTED.add((self, problem))

    # -- the contract --------------------------------------------------------------------------------
    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: bool = False,
        scale: float | None = None,
        seqlens_k: Any = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float = 0.0,
        alibi_slopes: Any = None,
    ) -> tuple[Any, Any]:
        """Attention forward.

        q: ``[B, H, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``; seqlens_k: integer ``[B]`` or None;
        window: ``(left, right)`` of ints or None, or None; softcap: 0.0 (off) or > 0; alibi_slopes: float32 ``[H]``
        or ``[B, H]``, or None (SPEC.md, "Score modifiers").
        Returns ``o`` (``[B, H, Nq, Dv]``, dtype of q) and ``lse`` (``[B, H, Nq]``, float32; float64 for float64).
        """
        problem = self._validate(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes)
        return self.forward_validated(q, k, v, problem)

    def forward_validated(self, q: Any, k: Any, v: Any, problem: Problem) -> tuple[Any, Any]:
        """``forward`` on inputs already validated into ``problem`` (by ``attention``, which validates once)."""
        self._check(problem)
        if _is_empty(problem):
            return _empty_forward(q, problem)
        with _on_device(problem):
            return self._forward(q, k, v, problem)

    def backward(
        self,
        do: Any,
        q: Any,
        k: Any,
        v: Any,
        o: Any,
        lse: Any,
        causal: bool = False,
        scale: float | None = None,
        seqlens_k: Any = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float = 0.0,
        alibi_slopes: Any = None,
    ) -> tuple[Any, Any, Any]:
        """Attention backward from the forward's ``o`` and ``lse``, with the forward's arguments.

        do, o: ``[B, H, Nq, Dv]``; lse: ``[B, H, Nq]`` as the forward returned it.  Returns ``dq`` (shape of q) and
        ``dk``, ``dv`` (shapes of k and v, summed over the query heads of each K/V group).  ALiBi slopes get no
        gradient.
        """
        problem = self._validate(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes)
        return self.backward_validated(do, q, k, v, o, lse, problem)

    def backward_validated(
        self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, problem: Problem
    ) -> tuple[Any, Any, Any]:
        """``backward`` on q, k, v already validated into ``problem`` (by ``attention``'s forward)."""
        validate_backward(problem, do, o, lse)
        self._check(problem)
        if _is_empty(problem):
            return _empty_backward(q, k, v)
        with _on_device(problem):
            return self._backward(do, q, k, v, o, lse, problem)

    def kvcache_forward(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, block_table: Tensor | None, kv: Any
    ) -> tuple[Tensor, Tensor]:
        """SPEC.md's KV-cache call after ``attnzoo.kvcache`` validated it (``kv``, a ``KVCacheProblem``) and appended
        the new keys: attention of q over the first ``lengths[b]`` keys of each sequence, causal and the score
        modifiers aligned to that length.  Implemented by the backends that declare ``Capabilities.kvcache``."""
        raise NotImplementedError(f"backend {self.name!r} does not answer the KV-cache call")

    def kvcache_reasons(self, kv: Any) -> list[str]:
        """Why this backend cannot answer the KV-cache call ``kv`` beyond what ``reasons_for(kv.problem)`` says."""
        return []

    def forward_varlen_validated(self, q: Any, k: Any, v: Any, problem: Problem) -> tuple[Any, Any]:
        """Packed forward (``attnzoo.attention_varlen``) on inputs validated into ``problem``
        (``attnzoo.varlen.validate_varlen``) -> ``o`` ``[total_q, H, Dv]``, ``lse`` ``[H, total_q]``."""
        self._check(problem)
        if q.shape[0] * problem.heads == 0:
            o = q.new_zeros((q.shape[0], problem.heads, problem.head_dim_v))
            return o, q.new_zeros((problem.heads, q.shape[0]), dtype=lse_dtype(problem.dtype))
        with _on_device(problem):
            return self._forward_varlen(q, k, v, problem)

    def forward_fp8(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor, problem: Problem
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 forward (``attnzoo.attention_fp8``) on inputs validated into ``problem`` (``float8_e4m3fn``), with the
        float32 factors ``descale`` ``[B, Hkv, 3]`` -> ``o`` bfloat16, ``lse`` float32.  This default runs the
        backend's float32 forward on the real inputs (``fp8.forward_dequantized``); the Triton backends compute on
        the FP8 values."""
        from .fp8 import forward_dequantized

        return forward_dequantized(self, q, k, v, descale, problem)

    def backward_varlen_validated(
        self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, problem: Problem
    ) -> tuple[Any, Any, Any]:
        """Packed backward on inputs validated into ``problem`` (do, o, lse too: ``attnzoo.varlen``) -> ``dq``,
        ``dk``, ``dv``, packed as q, k, v."""
        self._check(problem)
        if q.shape[0] * problem.heads == 0:  # no query row: nothing reads a key
            return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        with _on_device(problem):
            return self._backward_varlen(do, q, k, v, o, lse, problem)

    def _forward(self, q, k, v, problem: Problem) -> tuple[Any, Any]:
        raise NotImplementedError

    def _backward(self, do, q, k, v, o, lse, problem: Problem) -> tuple[Any, Any, Any]:
        raise NotImplementedError

    # Packed variable-length batches (``attnzoo.attention_varlen``): by default one dense call per sequence
    # (``attnzoo.varlen``); a backend with packed kernels overrides these.  ``problem.is_varlen``; q is
    # ``[total_q, H, D]``, k/v ``[total_k, Hkv, D or Dv]``, o/do ``[total_q, H, Dv]``, lse ``[H, total_q]``; never
    # empty (total_q * H > 0).
    def _forward_varlen(self, q, k, v, problem: Problem) -> tuple[Any, Any]:
        from .varlen import forward_by_sequence

        return forward_by_sequence(self, q, k, v, problem)

    def _backward_varlen(self, do, q, k, v, o, lse, problem: Problem) -> tuple[Any, Any, Any]:
        from .varlen import backward_by_sequence

        return backward_by_sequence(self, do, q, k, v, o, lse, problem)

    def options(self) -> dict[str, Any]:
        """The constructor options of this instance that differ from the registered defaults."""
        shown = {}
        for name, param in _option_parameters(type(self)).items():
            value = getattr(self, name, param.default)
            if value != param.default and not (param.default is None and not value):  # configs={} is configs=None
                shown[name] = value
        return shown

    def __repr__(self) -> str:
        shown = "".join(f" {name}={_option_text(value)}" for name, value in self.options().items())
        return f"<attnzoo backend {self.name}{shown}>"


def _option_parameters(cls: type[Backend]) -> dict[str, inspect.Parameter]:
    """The keyword options of a backend class (its constructor's parameters; {} for a class without one)."""
    if cls.__init__ is object.__init__:
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {name: p for name, p in params.items() if name != "self" and p.kind is not p.VAR_KEYWORD}


def _option_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def _frozen(value: Any) -> Any:
    """A hashable stand-in for an option value (mappings and sequences by content)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _is_empty(problem: Problem) -> bool:
    """No query row at all (B, H or Nq is 0): nothing to compute, and no kernel is launched."""
    return problem.batch * problem.heads * problem.seqlen_q == 0


def _empty_forward(q, problem: Problem):
    """``o`` ``[B, H, Nq, Dv]`` and ``lse`` ``[B, H, Nq]``, both empty."""
    shape = (problem.batch, problem.heads, problem.seqlen_q)
    o_shape = (*shape, problem.head_dim_v)
    if isinstance(q, np.ndarray):
        return np.zeros(o_shape, q.dtype), np.zeros(shape, np.float64 if q.dtype == np.float64 else np.float32)
    return q.new_zeros(o_shape), torch.zeros(shape, dtype=lse_dtype(problem.dtype), device=q.device)


def _empty_backward(q, k, v):
    """``dq`` empty; ``dk``, ``dv`` zero: keys that no query reads get no gradient."""
    if isinstance(q, np.ndarray):
        return np.zeros(q.shape, q.dtype), np.zeros(k.shape, k.dtype), np.zeros(v.shape, v.dtype)
    return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)


def _on_device(problem: Problem) -> contextlib.AbstractContextManager:
    """Make the inputs' GPU the current one, so that kernels launch where the tensors are (cuda:1 with cuda:0
    current, say); nothing on the CPU."""
    if problem.device == "cuda":
        return torch.cuda.device(torch.device(problem.device_name))
    return contextlib.nullcontext()


# (backend, problem) of the problems without tensor arguments that passed ``Backend._check``.
_SUPPORTED: set[tuple] = set()
_REGISTRY: dict[str, Backend] = {}


def register(backend_cls: type[Backend]) -> type[Backend]:
    """Class decorator: instantiate the backend and register it under its ``name``."""
    instance = backend_cls()
    if not instance.name or instance.name in _REGISTRY:
        raise ValueError(f"backend name {instance.name!r} is empty or registered twice")
    _REGISTRY[instance.name] = instance
    return backend_cls


def names() -> list[str]:
    """Every registered backend's name, in registration order."""
    return list(_REGISTRY)


_VARIANTS: dict[tuple, Backend] = {}


def get(name: str, **options: Any) -> Backend:
    """The backend registered under ``name``; with ``options``, an instance of its class built with them.

    Options by backend: ``numpy_ref``, ``torch_fa1``, ``torch_fa2``: ``block_m``, ``block_n``; ``triton_2kernel``,
    ``triton_atomic``: ``configs`` (kernel name -> the ``KernelConfig`` or its text always used for that kernel, no
    tuning, e.g. ``{"forward": "128x64 w8 s3 tma", "dkdv": "64x64 w4 s2 gluon"}``); ``triton_atomic`` also
    ``delta`` ("preprocess" or "recompute").  The same options give the same instance.  An unknown option is a
    ``TypeError`` naming it.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    try:
        registered = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}") from None
    if not options:
        return registered
    known = _option_parameters(type(registered))
    for option in options:
        if option not in known:
            listed = ", ".join(known) or "none"
            raise TypeError(f"backend {name!r} has no option {option!r} (its options: {listed})")
    try:
        key = (name, _frozen(options))
        hash(key)
    except TypeError:  # an unhashable option value: a fresh instance, not cached
        return type(registered)(**options)
    instance = _VARIANTS.get(key)
    if instance is None:
        instance = _VARIANTS[key] = type(registered)(**options)
    return instance
