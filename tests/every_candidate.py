"""The loop that the every-candidate GPU tests share: each kernel's candidate configs pinned in turn, the outputs
checked, and the configs that cannot launch collected (the tuner skips those).  The rounds are split into ``SHARDS``
shards, each its own test, so that pytest-xdist compiles them in parallel (compiling dominates these tests)."""

from __future__ import annotations

from collections.abc import Callable

from triton.runtime.errors import OutOfResources

import attnzoo
from attnzoo.kernels.tuning import CANDIDATES, candidates, head_dim_tile

SHARDS = 4


def check_every_candidate(q, k, v, do, check: Callable[[tuple], None], shard: int, **kw) -> list[str]:
    """Run ``triton_2kernel`` and ``triton_atomic`` (both Delta variants) with every candidate of every kernel pinned,
    round-robin over the longest list, on the call ``(q, k, v, **kw)``; ``check`` judges each ``(o, lse, dq, dk, dv)``
    (the backward runs on the tuned forward's o and lse).  Only the rounds ``i`` with ``i % SHARDS == shard`` run.
    Returns the configs that ran out of resources."""
    D, Dv, dtype = q.shape[-1], v.shape[-1], q.dtype
    lists = {
        name: candidates(name, head_dim_tile(D), dtype, q.device, block_dv=head_dim_tile(Dv)) for name in CANDIDATES
    }
    o_ref, lse_ref = attnzoo.get("triton_2kernel").forward(q, k, v, **kw)
    out_of_resources = []
    for i in range(shard, max(len(c) for c in lists.values()), SHARDS):
        forced = {name: configs[i % len(configs)] for name, configs in lists.items()}
        two_kernel = attnzoo.get("triton_2kernel", configs={n: forced[n] for n in ("forward", "dq", "dkdv")})
        stage = "forward"
        try:
            o, lse = two_kernel.forward(q, k, v, **kw)
            stage = "dq/dkdv"
            grads = two_kernel.backward(do, q, k, v, o_ref, lse_ref, **kw)
            check((o, lse, *grads))
        except OutOfResources:
            out_of_resources.append(f"{stage}: {forced}")
        for delta in ("preprocess", "recompute"):
            atomic = attnzoo.get("triton_atomic", delta=delta, configs={"atomic": forced["atomic"]})
            try:
                grads = atomic.backward(do, q, k, v, o_ref, lse_ref, **kw)
            except OutOfResources:
                out_of_resources.append(f"atomic: {forced['atomic']}")
                continue
            check((o_ref, lse_ref, *grads))
    return sorted(set(out_of_resources))
