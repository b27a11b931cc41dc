"""Prefill, then 100 decode steps appending to a paged KV cache, each step replayed as one CUDA graph; every step's
output checked against the float64 oracle on the dense sequence so far.

    python examples/decode_loop.py            # needs a CUDA GPU
"""

from __future__ import annotations

import torch

import attnzoo
from attnzoo import oracle

B, H, HKV, D = 4, 16, 4, 128
PROMPT, STEPS, PAGE = 300, 100, 64
DTYPE, DEVICE = torch.bfloat16, "cuda"


def main() -> None:
    gen = torch.Generator(DEVICE).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=DTYPE, device=DEVICE)

    # The whole sequence's q, k, v up front (a model would produce them step by step): prompt + STEPS tokens.
    total = PROMPT + STEPS
    q_all, k_all, v_all = randn(B, H, total, D), randn(B, HKV, total, D), randn(B, HKV, total, D)

    # A paged cache: a pool of pages shared by the batch, each sequence's pages scattered through it.
    pages_per_seq = -(-total // PAGE)
    pool = B * pages_per_seq + 5
    k_cache, v_cache = randn(pool, HKV, PAGE, D), randn(pool, HKV, PAGE, D)  # stale contents, never read
    order = torch.randperm(pool, generator=gen, device=DEVICE)[: B * pages_per_seq]
    block_table = order.view(B, pages_per_seq).to(torch.int32)
    cache_seqlens = torch.zeros(B, dtype=torch.int32, device=DEVICE)

    # Prefill: the prompt attends to itself (causal) and is appended to the empty cache in the same call.
    prefill = attnzoo.attention_with_kvcache(
        q_all[:, :, :PROMPT], k_cache, v_cache, cache_seqlens,
        k_all[:, :, :PROMPT], v_all[:, :, :PROMPT], block_table, causal=True,
    )  # fmt: skip
    cache_seqlens += PROMPT

    # One decode step on static buffers, captured once as a CUDA graph: append this token's k/v, attend, advance.
    q_step, k_step, v_step = randn(B, H, 1, D), randn(B, HKV, 1, D), randn(B, HKV, 1, D)

    def step() -> torch.Tensor:
        o = attnzoo.attention_with_kvcache(q_step, k_cache, v_cache, cache_seqlens, k_step, v_step, block_table)
        cache_seqlens.add_(1)
        return o

    # Compile the kernels outside the capture on a scratch copy of the state, then capture.
    saved = (k_cache.clone(), v_cache.clone(), cache_seqlens.clone())
    torch.cuda.synchronize()
    step()
    k_cache.copy_(saved[0])
    v_cache.copy_(saved[1])
    cache_seqlens.copy_(saved[2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_step = step()
    cache_seqlens.copy_(saved[2])  # capture ran nothing, but be explicit about the state the replays start from

    outputs = []
    for t in range(PROMPT, total):
        q_step.copy_(q_all[:, :, t : t + 1])
        k_step.copy_(k_all[:, :, t : t + 1])
        v_step.copy_(v_all[:, :, t : t + 1])
        graph.replay()
        outputs.append(o_step.clone())
    torch.cuda.synchronize()

    # The judge: the float64 oracle on the dense sequence up to each step (causal, bottom-right), and plain PyTorch
    # in bfloat16 for SPEC.md's error budget.
    worst = 0.0
    checks = [("prefill", prefill, q_all[:, :, :PROMPT], PROMPT)]
    for t, o in zip(range(PROMPT, total), outputs, strict=True):
        checks.append((f"step {t - PROMPT}", o, q_all[:, :, t : t + 1], t + 1))
    for label, got, q, length in checks:
        k, v = k_all[:, :, :length], v_all[:, :, :length]
        exact = oracle.reference(q, k, v, causal=True, device=DEVICE)
        baseline = oracle.plain_torch(q, k, v, causal=True)
        check = oracle.check_output("o", got, exact.o, baseline.o, DTYPE)
        assert check.ok, f"{label}: {check.message}"
        worst = max(worst, check.ratio)
    assert int(cache_seqlens[0]) == total
    print(f"prefill {PROMPT} tokens + {STEPS} graph-replayed decode steps, paged (page {PAGE}), B={B} H={H} Hkv={HKV}")
    print(f"every step matches the float64 oracle on the dense sequence: worst error / bound = {worst:.2f}")


if __name__ == "__main__":
    main()
