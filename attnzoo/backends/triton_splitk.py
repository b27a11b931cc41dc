"""``triton_splitk``: flash-decoding.  The keys of each (batch, K/V head) are split across programs, each writes a
partial (o, lse), and a second kernel merges them by their log-sum-exp (``kernels/splitk.py``), so that a few query
rows over a long cache fill the GPU.  The query heads of a grouped-query group share one tile (a K/V tile is loaded
once per group), and paged caches are read through the block table directly.

It answers the KV-cache call (``attnzoo.attention_with_kvcache``, its purpose) and the plain forward (the same kernel
on a dense ``k``/``v`` with ``seqlens_k`` as the lengths).  Its backward is the two-kernel backward of
``triton_2kernel`` run on this forward's ``o`` and ``lse``: split-K is a forward technique (a backward has a query
row per key to parallelise over already).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..backend import Backend, Capabilities, new_output, register
from ..kernels.tuning import KernelConfig
from ._triton_base import TRITON_DTYPES, TRITON_MAX_HEAD_DIM, TritonBackend, kernels, triton_extra_reasons


def _splitk_attention():
    from ..kernels.splitk import splitk_attention  # imports Triton: on first use only

    return splitk_attention


@register
class TritonSplitK(TritonBackend):
    """Triton flash-decoding forward (split-K + LSE merge); two-kernel backward.

    ``num_splits``: key ranges per (batch, K/V head) (None: from the SM count and the cache's capacity,
    ``kernels.splitk.choose_num_splits``); ``block_n``, ``num_warps``, ``num_stages``: the partial kernel's launch;
    ``configs``: the backward kernels' ("dq", "dkdv") configs, as for ``triton_2kernel``.
    """

    name = "triton_splitk"
    kernel_names = ("dq", "dkdv")
    capabilities = Capabilities(
        summary=(
            "Triton flash-decoding forward: keys split across programs, partial (o, lse) merged by a second kernel; "
            "GQA group packed into one tile, paged caches read through the block table; two-kernel backward"
        ),
        devices=frozenset({"cuda", "cpu"}),
        dtypes=TRITON_DTYPES,
        max_head_dim=TRITON_MAX_HEAD_DIM,
        deterministic=True,
        extra_reasons=triton_extra_reasons,
        kvcache=True,
        kvcache_auto_rank={"cuda": 0},
    )
    # The FP8 forward on the FP8 values is the dense forward kernel's (triton_2kernel); this backend's split-K
    # kernel takes no FP8, so FP8 calls run its float32 forward on the real inputs, as the reference backends do.
    forward_fp8 = Backend.forward_fp8

    def __init__(
        self,
        num_splits: int | None = None,
        block_n: int = 64,
        num_warps: int = 4,
        num_stages: int = 3,
        configs: Mapping[str, KernelConfig | str] | None = None,
    ) -> None:
        super().__init__(configs)
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
        if block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_n must be one of 16, 32, 64, 128, 256, got {block_n!r}")
        self.num_splits, self.block_n = num_splits, block_n
        self.num_warps, self.num_stages = num_warps, num_stages

    def _launch(self, q, k, v, problem, lengths, block_table, align_to_length):
        return _splitk_attention()(
            q, k, v, problem, lengths=lengths, block_table=block_table, align_to_length=align_to_length,
            num_splits=self.num_splits, block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
            new_output=lambda shape, dtype: new_output(shape, dtype, q.device),
        )  # fmt: skip

    def _forward(self, q, k, v, problem):
        lengths = problem.seqlens_k
        if lengths is not None:
            lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()
        return self._launch(q, k, v, problem, lengths, None, align_to_length=False)

    def kvcache_forward(self, q, k_cache, v_cache, lengths, block_table, kv):
        return self._launch(q, k_cache, v_cache, kv.problem, lengths, block_table, align_to_length=True)

    def backward_prepared(self, call, do, o, lse):
        return kernels().backward_2kernel(call, do, o, lse)
