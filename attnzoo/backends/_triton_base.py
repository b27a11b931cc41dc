"""What the Triton backends (``triton_2kernel``, ``triton_atomic``) share: the support rules, the ``configs`` option
and the forward.

Triton is optional: where it imports, the kernel modules are imported with this module (defining the kernels costs
about half a second, better paid at ``import attnzoo`` than inside the first call; ``TRITON_INTERPRET`` must be set
before); where it does not, ``import attnzoo`` still works and the Triton backends say why in
``not_supported_reasons``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from .._env import interpreter_unusable_reason, triton_interpreter_active
from ..backend import Backend, _on_device
from ..kernels.tuning import KernelConfig
from ..validation import Problem

TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
TRITON_MAX_HEAD_DIM = 256

INTERPRETER_REASON = "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
INTERPRETER_BF16_REASON = (
    "bfloat16 is not supported on the CPU: under the Triton interpreter (triton 3.6-3.9) tl.dot on bfloat16 "
    "computes on the raw uint16 bits (interpreter bug); bfloat16 is checked on the GPU"
)


INTERPRETER_FP8_REASON = (
    "FP8 runs on the GPU only: under the Triton interpreter (triton 3.6-3.9) the float32 -> float8e4nv rounding drops "
    "the carry into the exponent (0.49 becomes 0.25, not 0.5)"
)


@functools.cache
def triton_missing_reason() -> str | None:
    """Why no Triton kernel can run in this environment (None when Triton imports)."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed (pip install triton): {error}"
    return None


def triton_extra_reasons(problem: Problem) -> list[str]:
    """Triton must import; CPU inputs run only through the Triton interpreter, and not in bfloat16 there."""
    missing = triton_missing_reason()
    if missing:
        return [missing]
    reasons = []
    if problem.device == "cpu":
        if not triton_interpreter_active():
            reasons.append(INTERPRETER_REASON)
        elif (unusable := interpreter_unusable_reason()) is not None:
            reasons.append(unusable)
        if problem.dtype == torch.bfloat16:
            reasons.append(INTERPRETER_BF16_REASON)
    return reasons


@functools.cache
def kernels() -> SimpleNamespace:
    """The kernel entry points, imported on first use (this imports Triton)."""
    from ..kernels.backward_2kernel import attention_backward_2kernel
    from ..kernels.backward_atomic import attention_backward_atomic
    from ..kernels.forward import attention_forward
    from ..kernels.launch import KernelVariant, prepare

    return SimpleNamespace(
        prepare=prepare,
        KernelVariant=KernelVariant,
        forward=attention_forward,
        backward_2kernel=attention_backward_2kernel,
        backward_atomic=attention_backward_atomic,
    )


def _import_kernels_if_available() -> None:
    if triton_missing_reason() is None:
        try:
            kernels()
        except Exception:  # a Triton that imports but cannot define the kernels: the first launch says why
            kernels.cache_clear()


_import_kernels_if_available()


def parse_configs(configs: Mapping[str, KernelConfig | str] | None, kernel_names: tuple[str, ...]) -> dict:
    """``configs`` option -> {kernel name: KernelConfig}; ValueError/TypeError naming a bad entry."""
    if configs is None:
        return {}
    if not isinstance(configs, Mapping):
        raise TypeError(f"configs must be a mapping of kernel name -> config, got {type(configs).__name__}")
    parsed = {}
    for kernel, cfg in configs.items():
        if kernel not in kernel_names:
            raise ValueError(f"configs: unknown kernel {kernel!r}; this backend's kernels: {', '.join(kernel_names)}")
        parsed[kernel] = cfg if isinstance(cfg, KernelConfig) else KernelConfig.parse(cfg)
    return parsed


class TritonBackend(Backend):
    """The forward and the support rules shared by the Triton backends; subclasses add the backward.

    ``configs``: kernel name -> the config always used for that kernel (no tuning), e.g.
    ``{"forward": "128x64 w8 s3 tma", "dkdv": "64x64 w4 s2 gluon"}``; kernels left out are tuned as usual.
    """

    kernel_names: tuple[str, ...] = ("forward",)

    def __init__(self, configs: Mapping[str, KernelConfig | str] | None = None) -> None:
        self.configs = parse_configs(configs, self.kernel_names)

    def prepare(self, q: Any, k: Any, v: Any, problem: Problem, counts: dict | None = None):
        """The prepared call of validated, supported inputs (``counts``: a dict that debug builds record their
        per-program tile counts in)."""
        return kernels().prepare(q, k, v, problem, forced=self.configs, counts=counts)

    def _forward(self, q, k, v, problem):
        return kernels().forward(self.prepare(q, k, v, problem))

    def _backward(self, do, q, k, v, o, lse, problem):
        return self.backward_prepared(self.prepare(q, k, v, problem), do, o, lse)

    def forward_fp8(self, q, k, v, descale, problem):
        """On the FP8 values (``kernels/forward.py``, DESCALE): the support rules of a 16-bit call, on a GPU with
        FP8 tensor cores (compute capability 8.9 and later).  v goes to the kernel with its keys contiguous (a copy
        unless ``v.stride(-2) == 1``): ``P V``'s right operand must be K-major for the FP8 tensor-core product."""
        refused = f"backend {self.name!r} does not support this input:"
        if problem.device != "cuda":
            raise NotImplementedError(f"{refused} {INTERPRETER_FP8_REASON}")
        if torch.version.hip is not None or torch.cuda.get_device_capability(q.device) < (8, 9):
            raise NotImplementedError(f"{refused} FP8 needs an NVIDIA GPU of compute capability 8.9 or later")
        self._check(dataclasses.replace(problem, dtype=torch.float16))
        if problem.batch * problem.heads * problem.seqlen_q == 0:
            return super().forward_fp8(q, k, v, descale, problem)
        if v.stride(-2) != 1:
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
        with _on_device(problem):
            call = kernels().prepare(q, k, v, problem, forced=self.configs, descale=descale)
            return kernels().forward(call)

    def _forward_varlen(self, q, k, v, problem):
        # The packed tensors as they are: the kernels map programs to (sequence, block) pairs (kernels/common.py).
        return kernels().forward(self.prepare(q, k, v, problem))

    def _backward_varlen(self, do, q, k, v, o, lse, problem):
        return self.backward_prepared(self.prepare(q, k, v, problem), do, o, lse)

    def backward_prepared(self, call, do, o, lse):
        """The backward kernels on a prepared call -> dq, dk, dv."""
        raise NotImplementedError

    def counted_run(self, q: Any, k: Any, v: Any, problem: Problem, backward: bool = False) -> dict[str, Any]:
        """Run the forward (and with ``backward`` the backward, on the forward's ``o``/``lse`` and a random ``dO``)
        built with tile counters; returns kernel name -> int32 ``[programs, 2]`` (visited, skipped) counts.

        ``problem``: validated and supported (``Backend.not_supported_reasons`` is empty).  Used by ``attnzoo.debug``.
        """
        counts: dict = {}
        call = self.prepare(q, k, v, problem, counts=counts)
        o, lse = kernels().forward(call)
        if backward:
            self.backward_prepared(call, torch.randn_like(q), o, lse)
        return {variant.kernel: buf for variant, buf in counts.items()}
