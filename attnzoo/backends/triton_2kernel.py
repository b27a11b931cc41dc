"""``triton_2kernel``: Triton FA2 forward; backward without atomics (a Q-stationary dQ kernel that also computes
Delta, then a K/V-stationary dK/dV kernel).  On Hopper the tuner may pick Gluon versions of the forward and of both
backward kernels (``kernels/forward_gluon.py``, ``kernels/backward_gluon.py``, ``kernels/backward_gluon_dq.py``).
The kernels live in :mod:`attnzoo.kernels`; what both Triton backends share in :mod:`._triton_base`.

On CPU tensors the kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported); that path is for tests only and is never picked by ``backend="auto"``.
"""

from __future__ import annotations

import dataclasses

from ..backend import Capabilities, register
from ..kvcache import dense_copy
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
            "Hopper also Gluon forward, dK/dV and dQ kernels that overlap the softmax with the products"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        deterministic=True,
        auto_rank={"cuda": 0},
        extra_reasons=triton_extra_reasons,
        kvcache=True,
        kvcache_auto_rank={"cuda": 5},
    )

    def backward_prepared(self, call, do, o, lse):
        return kernels().backward_2kernel(call, do, o, lse)

    # The KV-cache call through the forward kernel, with no split: the zoo's baseline for triton_splitk.  A paged
    # cache is gathered into a dense copy first.  The kernel masks keys past each length (seqlens_k) but aligns
    # causal, the window and ALiBi to Nk (the capacity), so it answers the calls where that alignment changes
    # nothing: no window, no ALiBi, and causal only with one query row (which then sees every key either way).
    def kvcache_reasons(self, kv):
        p = kv.problem
        if p.window is not None or p.has_alibi or (p.causal and p.seqlen_q > 1):
            return [
                "causal with Nq > 1, window and ALiBi (aligned to each sequence's length in the KV-cache call; the "
                "forward kernel aligns them to Nk)"
            ]
        return []

    def kvcache_forward(self, q, k_cache, v_cache, lengths, block_table, kv):
        if block_table is not None:
            k_cache, v_cache = dense_copy(k_cache, block_table), dense_copy(v_cache, block_table)
        return self.forward_validated(q, k_cache, v_cache, dataclasses.replace(kv.problem, seqlens_k=lengths))
