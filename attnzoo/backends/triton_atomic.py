"""``triton_atomic``: the shared Triton FA2 forward; backward in one Q-stationary kernel whose dK/dV
contributions are added with ``tl.atomic_add`` into float32 buffers.

The row term ``D_i = rowsum(dP_i * P_i)`` of the backward has two variants, chosen per instance:

- ``delta="preprocess"`` (the registered default): ``rowsum(dO * O)`` from a preprocess kernel;
- ``delta="recompute"``: the original design, a second pass over K/V inside the kernel.

``attnzoo.get("triton_atomic")`` is the default instance; ``attnzoo.get("triton_atomic", delta="recompute")`` the
other one.  The order of the atomic additions changes from run to run, so dK/dV are not bitwise reproducible
(``deterministic=False``).

On Hopper (``delta="preprocess"``) the tuner also has the five-product backward: the Gluon K/V-stationary kernel of
``kernels/backward_gluon.py`` computes dK and dV of its keys in registers and adds each Q tile's dQ share into a
float32 buffer by TMA reductions (atomic additions of a shared-memory tile); there dQ is the sum that varies in
order.  Its 128-key block is warp-specialised, each warpgroup adding 64 of dQ's columns at D = 128 and its own
keys' share at D = 64; on the H100 its backward ran 0.89-0.94x cuDNN's at D = 128 and 0.83-0.91x at D = 64 on the
grids, and 0.91-1.03x and 0.86-0.92x in later A/B processes with the dQ staging rows permuted (docs/design.md).
``deterministic=True`` adds those shares in a fixed order (locks per dQ tile, taken in block order, FlashAttention-3's
scheme): the whole backward is then bitwise reproducible, and calls outside that kernel's scope run the two-kernel
backward (reproducible too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..backend import Capabilities, register
from ..kernels.tuning import KernelConfig
from ._triton_base import (
    TRITON_DTYPES,
    TRITON_MAX_HEAD_DIM,
    TritonBackend,
    kernels,
    triton_extra_reasons,
)

DELTA_MODES = ("recompute", "preprocess")
DEFAULT_DELTA = "preprocess"


@register
class TritonAtomic(TritonBackend):
    """Triton FA2 forward; Q-stationary backward with atomic dK/dV.

    ``delta``: "preprocess" or "recompute" (how D_i is obtained); ``configs``: kernel ("forward", "atomic") -> the
    config always used for it; ``deterministic``: a bitwise reproducible backward (see the module docstring; with
    "preprocess" only).
    """

    name = "triton_atomic"
    kernel_names = ("forward", "atomic")
    capabilities = Capabilities(
        summary=(
            "Triton FA2 forward (on Hopper also the Gluon one); one Q-stationary backward kernel, dK/dV added "
            "with tl.atomic_add; on Hopper also a K/V-stationary Gluon backward of five products per tile, dQ added "
            "by TMA reductions (in a fixed order with deterministic=True), warp-specialised"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        deterministic=False,
        auto_rank={"cuda": 1},
        extra_reasons=triton_extra_reasons,
    )

    def __init__(
        self,
        delta: str = DEFAULT_DELTA,
        configs: Mapping[str, KernelConfig | str] | None = None,
        deterministic: bool = False,
    ) -> None:
        if delta not in DELTA_MODES:
            raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta!r}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        if deterministic and delta != "preprocess":
            raise ValueError("deterministic=True needs delta='preprocess' (the ordered dQ is the Hopper kernel's)")
        super().__init__(configs)
        pinned = self.configs.get("atomic") if self.configs else None
        if deterministic and pinned is not None and not pinned.gluon:
            raise ValueError(
                f"deterministic=True with configs['atomic'] = {str(pinned)!r}: the ordered dQ additions are the Gluon "
                "kernel's (pin a 'gluon' config or none)"
            )
        self.delta = delta
        self.deterministic = deterministic
        if deterministic:
            self.capabilities = dataclasses.replace(type(self).capabilities, deterministic=True)

    def backward_prepared(self, call, do, o, lse):
        return kernels().backward_atomic(call, do, o, lse, self.delta, ordered=self.deterministic)
