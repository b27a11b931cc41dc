"""``triton_2kernel``: Triton FA2 forward; backward without atomics (a Q-stationary dQ kernel that also computes
Delta, then a K/V-stationary dK/dV kernel).  On Hopper the tuner may pick Gluon versions of the forward and of the
dK/dV kernel (``kernels/forward_gluon.py``, ``kernels/backward_gluon.py``).  The kernels live in
:mod:`attnzoo.kernels`; what both Triton backends share in :mod:`._triton_base`.

On CPU tensors the kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported); that path is for tests only and is never picked by ``backend="auto"``.
"""

from __future__ import annotations

from ..backend import Capabilities, register
from ._triton_base import (
    TRITON_DTYPES,
    TRITON_MAX_HEAD_DIM,
    TritonBackend,
    kernels,
    triton_extra_reasons,
)


@register
class Triton2Kernel(TritonBackend):
    """Triton FA2 forward; deterministic backward in two kernels (dK/dV stationary on K/V, dQ stationary on Q).

    ``configs``: kernel ("forward", "dq", "dkdv") -> the config always used for it (``attnzoo.get(name, configs=...)``).
    """

    name = "triton_2kernel"
    kernel_names = ("forward", "dq", "dkdv")
    capabilities = Capabilities(
        summary=(
            "Triton FA2 forward; backward without atomics: Q-stationary dQ (and Delta), K/V-stationary dK/dV; on "
            "Hopper also Gluon forward and dK/dV kernels that overlap the softmax with the products"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        deterministic=True,
        auto_rank={"cuda": 0},
        extra_reasons=triton_extra_reasons,
    )

    def backward_prepared(self, call, do, o, lse):
        return kernels().backward_2kernel(call, do, o, lse)
