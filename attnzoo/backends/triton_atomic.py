"""``triton_atomic``: the shared Triton FA2 forward; backward in one Q-stationary kernel whose dK/dV
contributions are added with ``tl.atomic_add`` into float32 buffers.

The row term ``D_i = rowsum(dP_i * P_i)`` of the backward has two variants, chosen per instance:

- ``TritonAtomic(delta="preprocess")`` (the registered default): ``rowsum(dO * O)`` from a preprocess kernel;
- ``TritonAtomic(delta="recompute")``: the original design, a second pass over K/V inside the kernel.

``attnzoo.get("triton_atomic")`` is the default instance; the benchmark builds the other one with
:func:`variant` (or the constructor).  The order of the atomic additions changes from run to run, so dK/dV
are not bitwise reproducible (``deterministic=False``).
"""

from __future__ import annotations

from ..backend import Capabilities, register
from ..kernels.backward_atomic import DELTA_MODES, attention_backward_atomic
from .triton_2kernel import (
    TRITON_DTYPES,
    TRITON_FEATURES,
    TRITON_MAX_HEAD_DIM,
    TritonBackend,
    make_context,
    triton_extra_reasons,
)

DEFAULT_DELTA = "preprocess"


@register
class TritonAtomic(TritonBackend):
    """Triton FA2 forward; Q-stationary backward with atomic dK/dV (``delta``: "preprocess" or "recompute")."""

    name = "triton_atomic"
    capabilities = Capabilities(
        summary=(
            "Triton FA2 forward (on Hopper also the Gluon one); one Q-stationary backward kernel, dK/dV added "
            "with tl.atomic_add"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        features=TRITON_FEATURES,
        deterministic=False,
        auto_rank={"cuda": 1},
        extra_reasons=triton_extra_reasons,
    )

    def __init__(self, delta: str = DEFAULT_DELTA) -> None:
        if delta not in DELTA_MODES:
            raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta!r}")
        self.delta = delta

    def _backward(self, do, q, k, v, o, lse, problem):
        return attention_backward_atomic(make_context(q, k, v, problem, problem.seqlens_k), do, o, lse, self.delta)

    def __repr__(self) -> str:
        return f"<attnzoo backend {self.name} delta={self.delta}>"


def variant(delta: str) -> TritonAtomic:
    """A ``triton_atomic`` instance with the given D_i variant ("preprocess" or "recompute"), not registered."""
    return TritonAtomic(delta=delta)
