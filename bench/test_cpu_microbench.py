"""pytest-benchmark micro-benchmarks of the CPU backends (numpy_ref, torch_fa1, torch_fa2), run on demand:

    pytest bench/test_cpu_microbench.py --benchmark-only                 # table of min/median/max per case
    pytest bench/test_cpu_microbench.py --benchmark-only --benchmark-autosave   # keep them in .benchmarks/

Not collected by the default ``pytest`` run (its testpaths is ``tests/``).  Shapes are small enough for a laptop;
float32, fresh standard-normal inputs per test, one forward or one backward (on the forward's own o/lse) per round.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo

BACKENDS = ("numpy_ref", "torch_fa1", "torch_fa2")
SHAPES = [(1, 4, 256, 64), (1, 4, 1024, 64)]  # B, H, N, D


def _inputs(B: int, H: int, N: int, D: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=gen) for _ in range(4)]  # q, k, v, do


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}N{}D{}".format(*s))
@pytest.mark.parametrize("name", BACKENDS)
def test_forward(benchmark, name, shape, causal):
    q, k, v, _ = _inputs(*shape)
    backend = attnzoo.get(name)
    benchmark.group = f"forward {'causal' if causal else 'full'} B{shape[0]}H{shape[1]}N{shape[2]}D{shape[3]}"
    o, _lse = benchmark(backend.forward, q, k, v, causal=causal)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}N{}D{}".format(*s))
@pytest.mark.parametrize("name", BACKENDS)
def test_backward(benchmark, name, shape, causal):
    q, k, v, do = _inputs(*shape)
    backend = attnzoo.get(name)
    o, lse = backend.forward(q, k, v, causal=causal)
    benchmark.group = f"backward {'causal' if causal else 'full'} B{shape[0]}H{shape[1]}N{shape[2]}D{shape[3]}"
    dq, dk, dv = benchmark(backend.backward, do, q, k, v, o, lse, causal=causal)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
