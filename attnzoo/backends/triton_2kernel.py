"""``triton_2kernel``: Triton FA2 forward; backward without atomics (a Q-stationary dQ kernel that also computes
Delta, then a K/V-stationary dK/dV kernel).  On Hopper the autotuner may pick Gluon versions of the forward and of the
dK/dV kernel (``kernels/forward_gluon.py``, ``kernels/backward_gluon.py``).  The kernels live in
:mod:`attnzoo.kernels`.

On CPU tensors the kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported); that path is for tests only and is never picked by ``backend="auto"``.
"""

from __future__ import annotations

import torch

from ..backend import (
    REQUIRED_FEATURES,
    SCORE_MODIFIER_FEATURES,
    Backend,
    Capabilities,
    register,
    triton_interpreter_active,
)
from ..kernels.backward_2kernel import attention_backward_2kernel
from ..kernels.forward import attention_forward
from ..kernels.launch import LaunchContext
from ..kernels.tuning import KernelConfig
from ..validation import Problem

TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
TRITON_MAX_HEAD_DIM = 256
# Issue 25: the kernels do not apply SPEC.md's score modifiers (window, softcap, alibi) or take Dv != D yet, so
# not_supported_reasons names them.  When the kernels do, delete NOT_YET (and its entry in tests/cases.py).
NOT_YET = SCORE_MODIFIER_FEATURES
TRITON_FEATURES = REQUIRED_FEATURES - NOT_YET

INTERPRETER_REASON = "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
INTERPRETER_BF16_REASON = (
    "bfloat16 is not supported on the CPU: under the Triton interpreter (triton 3.6-3.9) tl.dot on bfloat16 "
    "computes on the raw uint16 bits (interpreter bug); bfloat16 is checked on the GPU"
)


def triton_extra_reasons(problem: Problem) -> list[str]:
    """CPU inputs run only through the Triton interpreter, and not in bfloat16 there."""
    reasons = []
    if problem.device == "cpu":
        if not triton_interpreter_active():
            reasons.append(INTERPRETER_REASON)
        if problem.dtype == torch.bfloat16:
            reasons.append(INTERPRETER_BF16_REASON)
    return reasons


def make_context(
    q, k, v, problem: Problem, seqlens_k, debug: bool = False, forced_config: KernelConfig | None = None
) -> LaunchContext:
    """The launch context of one validated call (inputs are passed with their strides, never copied)."""
    return LaunchContext(
        q=q,
        k=k,
        v=v,
        scale=problem.scale,
        causal=problem.causal,
        seqlens_k=seqlens_k,
        debug=debug,
        forced_config=forced_config,
    )


class TritonBackend(Backend):
    """The forward and the support rules shared by the Triton backends; subclasses add the backward."""

    def _forward(self, q, k, v, problem):
        return attention_forward(make_context(q, k, v, problem, problem.seqlens_k))


@register
class Triton2Kernel(TritonBackend):
    """Triton FA2 forward; deterministic backward in two kernels (dK/dV stationary on K/V, dQ stationary on Q)."""

    name = "triton_2kernel"
    capabilities = Capabilities(
        summary=(
            "Triton FA2 forward; backward without atomics: Q-stationary dQ (and Delta), K/V-stationary dK/dV; on "
            "Hopper also Gluon forward and dK/dV kernels that overlap the softmax with the products"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        features=TRITON_FEATURES,
        deterministic=True,
        auto_rank={"cuda": 0},
        extra_reasons=triton_extra_reasons,
    )

    def _backward(self, do, q, k, v, o, lse, problem):
        return attention_backward_2kernel(make_context(q, k, v, problem, problem.seqlens_k), do, o, lse)
