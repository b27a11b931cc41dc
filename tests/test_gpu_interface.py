"""The interface on a CUDA GPU: auto picks a Triton backend, the drop-in trains like SDPA, the blocked PyTorch
backends stay O(N) in memory.  Run with ``pytest -m gpu`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.testing import random_inputs

pytestmark = pytest.mark.gpu


def test_auto_prefers_triton_2kernel_on_cuda():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    assert attnzoo.pick_backend(q, q, q, True, None, None).name == "triton_2kernel"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_training_step_matches_sdpa(dtype):
    x = random_inputs(2, 8, 8, 1000, 1000, 64, dtype=dtype, device="cuda", seed=0)
    q, k, v, grad_out = x.q, x.k, x.v, x.do
    results = []
    for fn in (
        lambda a, b, c: attnzoo.attention(a, b, c, causal=True),
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
    ):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad_out)
        results.append([out.detach(), *[x.grad for x in leaves]])
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, **tol)


@pytest.mark.parametrize("name", ["torch_fa1", "torch_fa2"])
def test_blocked_pytorch_backends_never_hold_n_by_n(name):
    """At N = 8192 one N x N float32 score matrix is 256 MiB; the blocked backends need O(N*D + block^2)."""
    q = torch.randn(1, 1, 8192, 64, device="cuda", dtype=torch.float16)
    backend = attnzoo.get(name)
    # One small call first: one-time allocations (cuBLAS's workspace, 32 MiB on Hopper) are not the backend's.
    small = q[:, :, :128]
    backend.backward(small, small, small, small, *backend.forward(small, small, small, causal=True), causal=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, lse = backend.forward(q, q, q, causal=True)
    backend.backward(q, q, q, q, o, lse, causal=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 32 * 2**20, f"{name}: peak {peak / 2**20:.1f} MiB"
