"""The backend interface, each backend's declared capabilities, and the registry.

A backend declares what it supports in one :class:`Capabilities` object.  Support questions
(:meth:`Backend.not_supported_reasons`), ``backend="auto"``, the README's backend table and the
property tests all read that one declaration.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .validation import Problem, lse_dtype, validate_backward, validate_forward

Tensor = torch.Tensor

# Features of SPEC.md that every backend must support; the property tests check the declarations against it.
REQUIRED_FEATURES = frozenset({"causal", "seqlens_k", "gqa", "nq_ne_nk", "strided"})


def triton_interpreter_active() -> bool:
    """Whether Triton kernels run on the CPU through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_unusable_reason() -> str | None:
    """Why the installed Triton's interpreter cannot run kernels with the installed NumPy (None when it can).

    The interpreters of Triton 3.2 and 3.6 convert one-element arrays to Python scalars with ``int()``, which NumPy
    2.4 refuses for arrays of rank above 0 (every interpreted kernel then fails inside Triton); 3.8 squeezes the
    array first.  Releases between were not tried and are treated like their neighbours.
    """
    import triton

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())

    if version(triton.__version__) < (3, 8) and version(np.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter fails with NumPy {np.__version__} (int() of a one-element "
            "array); use NumPy < 2.4 or Triton >= 3.8"
        )
    return None


def poison_outputs() -> bool:
    """Whether outputs are NaN-filled before a kernel writes them (``ATTNZOO_POISON_OUTPUTS=1``, set by the tests)."""
    return os.environ.get("ATTNZOO_POISON_OUTPUTS", "0") not in ("", "0")


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """An uninitialised output tensor that a backend fills completely.

    Under ``ATTNZOO_POISON_OUTPUTS=1`` it starts as NaN, so that an element the kernel forgets to write
    fails the tests instead of passing with whatever the allocator left there.
    """
    if poison_outputs():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared once.

    ``auto_rank`` orders the backends that ``attention(..., backend="auto")`` may pick on each device
    type (lower is preferred); a device type absent from it is never picked automatically.
    ``extra_reasons`` adds backend-specific checks that the generic fields cannot express.
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
        if caps.max_head_dim is not None and problem.head_dim > caps.max_head_dim:
            reasons.append(f"head dim {problem.head_dim} above the limit {caps.max_head_dim}")
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
    ) -> list[str]:
        """Validate the inputs and return why this backend cannot run them ([] when it can).

        Bad input, a head dim above the backend's limit included, raises as in ``forward``.
        """
        problem = self._validate(q, k, v, causal, scale, seqlens_k)
        self._check_head_dim(problem)
        return self.reasons_for(problem)

    def _validate(self, q, k, v, causal, scale, seqlens_k) -> Problem:
        return validate_forward(q, k, v, causal, scale, seqlens_k, allow_numpy=self.capabilities.accepts_numpy)

    def _check_head_dim(self, problem: Problem) -> None:
        limit = self.capabilities.max_head_dim
        if limit is not None and problem.head_dim > limit:
            raise ValueError(
                f"q has head dim D={problem.head_dim}, above the limit of backend {self.name!r} (D <= {limit})"
            )

    def _check(self, problem: Problem) -> None:
        self._check_head_dim(problem)
        reasons = self.reasons_for(problem)
        if reasons:
            raise NotImplementedError(f"backend {self.name!r} does not support this input: " + "; ".join(reasons))

    # -- the contract --------------------------------------------------------------------------------
    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: bool = False,
        scale: float | None = None,
        seqlens_k: Any = None,
    ) -> tuple[Any, Any]:
        """Attention forward.

        q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``; seqlens_k: integer ``[B]`` or None.
        Returns ``o`` (``[B, H, Nq, D]``, dtype of q) and ``lse`` (``[B, H, Nq]``, float32; float64 for float64).
        """
        return self.forward_validated(q, k, v, self._validate(q, k, v, causal, scale, seqlens_k), seqlens_k)

    def forward_validated(self, q: Any, k: Any, v: Any, problem: Problem, seqlens_k: Any) -> tuple[Any, Any]:
        """``forward`` on inputs already validated into ``problem`` (by ``attention``, which validates once)."""
        self._check(problem)
        if _is_empty(problem):
            return _empty_forward(q, problem)
        with _on_device(problem):
            return self._forward(q, k, v, problem, seqlens_k)

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
    ) -> tuple[Any, Any, Any]:
        """Attention backward from the forward's ``o`` and ``lse``.

        do, o: ``[B, H, Nq, D]``; lse: ``[B, H, Nq]`` as the forward returned it.  Returns ``dq`` (shape of q) and
        ``dk``, ``dv`` (shape of k, summed over the query heads of each K/V group).
        """
        return self.backward_validated(
            do, q, k, v, o, lse, self._validate(q, k, v, causal, scale, seqlens_k), seqlens_k
        )

    def backward_validated(
        self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, problem: Problem, seqlens_k: Any
    ) -> tuple[Any, Any, Any]:
        """``backward`` on q, k, v already validated into ``problem`` (by ``attention``'s forward)."""
        validate_backward(problem, do, o, lse)
        self._check(problem)
        if _is_empty(problem):
            return _empty_backward(q, k, v)
        with _on_device(problem):
            return self._backward(do, q, k, v, o, lse, problem, seqlens_k)

    def _forward(self, q, k, v, problem: Problem, seqlens_k) -> tuple[Any, Any]:
        raise NotImplementedError

    def _backward(self, do, q, k, v, o, lse, problem: Problem, seqlens_k) -> tuple[Any, Any, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attnzoo backend {self.name}>"


def _is_empty(problem: Problem) -> bool:
    """No query row at all (B, H or Nq is 0): nothing to compute, and no kernel is launched."""
    return problem.batch * problem.heads * problem.seqlen_q == 0


def _empty_forward(q, problem: Problem):
    """``o`` of the shape of q and ``lse`` ``[B, H, 0 or Nq]``, both empty."""
    shape = (problem.batch, problem.heads, problem.seqlen_q)
    if isinstance(q, np.ndarray):
        return np.zeros(q.shape, q.dtype), np.zeros(shape, np.float64 if q.dtype == np.float64 else np.float32)
    return q.new_zeros(q.shape), torch.zeros(shape, dtype=lse_dtype(problem.dtype), device=q.device)


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


def get(name: str) -> Backend:
    """The backend registered under ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}") from None
