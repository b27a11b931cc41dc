"""SPEC.md, "Calls": the registry, the autograd drop-in, NumPy inputs, and the reference backends' memory bound."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases import REFERENCE_BACKENDS, SPEC_DTYPES, TRITON_BACKENDS

import attnzoo
from attnzoo import oracle

CPU_FLOAT64 = [n for n in attnzoo.names() if torch.float64 in attnzoo.get(n).capabilities.dtypes]


def test_names_and_get():
    names = attnzoo.names()
    assert set(REFERENCE_BACKENDS) <= set(names)
    for name in names:
        backend = attnzoo.get(name)
        assert backend.name == name and isinstance(backend, attnzoo.Backend)


@pytest.mark.parametrize("name", attnzoo.names())
def test_declarations_cover_spec(name):
    caps = attnzoo.get(name).capabilities
    assert caps.summary
    if name in SPEC_DTYPES:
        assert SPEC_DTYPES[name] <= caps.dtypes, f"{name} must declare {SPEC_DTYPES[name] - caps.dtypes}"
    if name in TRITON_BACKENDS:
        assert "cuda" in caps.devices and caps.max_head_dim is not None and caps.max_head_dim >= 256


@pytest.mark.parametrize("name", CPU_FLOAT64)
@pytest.mark.parametrize(
    "shape, causal, seqlens",
    [((2, 4, 2, 7, 5, 6), True, (5, 2)), ((1, 2, 1, 3, 9, 4), False, None), ((1, 1, 1, 6, 6, 3), True, (0,))],
)
def test_gradcheck_float64(name, shape, causal, seqlens):
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, Nq, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=gen, requires_grad=True)
    lens = None if seqlens is None else torch.tensor(seqlens)

    def f(q, k, v):
        return attnzoo.attention(q, k, v, causal=causal, seqlens_k=lens, backend=name)

    # lse is float64 for float64 inputs, so the analytic gradient is float64-accurate; the finite differences set
    # the tolerance (their truncation error is about eps^2 = 1e-12 relative, their rounding 1e-16 / eps).
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_a_drop_in_for_sdpa(causal):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=gen, requires_grad=True) for _ in range(3))
    o = attnzoo.attention(q, k, v, causal=causal)
    o.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o_ref.square().sum().backward()
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-5)
    for g, x in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, x.grad, atol=1e-4, rtol=1e-4)


def test_attention_gqa_matches_sdpa_with_repeated_heads():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 6, 10, 8, generator=gen)
    k, v = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(2))
    o = attnzoo.attention(q, k, v, scale=0.5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.5)
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-5)


def test_auto_picks_the_preferred_supported_backend_on_cpu():
    q = torch.randn(1, 2, 8, 16)
    ranked = sorted(
        (attnzoo.get(n).capabilities.auto_rank["cpu"], n)
        for n in attnzoo.names()
        if "cpu" in attnzoo.get(n).capabilities.auto_rank
    )
    assert attnzoo.pick_backend(q, q, q, False, None, None).name == ranked[0][1]
    assert not any(n.startswith("triton") for _, n in ranked), "the interpreter is never picked automatically"


def test_numpy_ref_takes_and_returns_numpy_arrays():
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 9, 8)) for _ in range(4))
    backend = attnzoo.get("numpy_ref")
    o, lse = backend.forward(q, k, v, causal=True)
    dq, dk, dv = backend.backward(do, q, k, v, o, lse, causal=True)
    assert all(isinstance(x, np.ndarray) for x in (o, lse, dq, dk, dv))
    assert o.dtype == np.float64 and lse.dtype == np.float64
    ref = oracle.reference(q, k, v, do, causal=True)
    np.testing.assert_allclose(o, ref.o.numpy(), atol=1e-12)
    np.testing.assert_allclose(dk, ref.dk.numpy(), atol=1e-12)
    o16, _ = backend.forward(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    assert o16.dtype == np.float16


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_numpy_ref_backward_gives_hidden_keys_p_zero_without_overflow():
    """A key the causal mask hides may score far above the row's lse; its P is 0, not exp(huge) masked later."""
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 1, 8, 4)) for _ in range(4))
    k[..., 7, :] = 1000 * q[..., 0, :]  # row 0 sees only key 0; its score against key 7 is ~1000 |q_0|^2
    backend = attnzoo.get("numpy_ref")
    o, lse = backend.forward(q, k, v, causal=True, scale=1.0)
    dq, dk, dv = backend.backward(do, q, k, v, o, lse, causal=True, scale=1.0)
    ref = oracle.reference(q, k, v, do, causal=True, scale=1.0)
    # lse is float64 for float64 inputs: the gradients are exact to float64 rounding of the scores (|S| ~ 1000).
    np.testing.assert_allclose(dq, ref.dq.numpy(), atol=1e-9)
    np.testing.assert_allclose(dk, ref.dk.numpy(), atol=1e-9)
    np.testing.assert_allclose(dv, ref.dv.numpy(), atol=1e-9)


def test_numpy_ref_never_holds_an_n_by_n_array():
    """Peak memory O(N*D + block^2): at N = 2048 an N x N float32 array alone would take 16 MiB."""
    n, d = 2048, 16
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(3))
    backend = attnzoo.get("numpy_ref")
    tracemalloc.start()
    o, lse = backend.forward(q, k, v, causal=True)
    backend.backward(q, q, k, v, o, lse, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", attnzoo.names())
@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [((0, 2, 5, 16), (0, 1, 5, 16)), ((2, 2, 0, 16), (2, 1, 7, 16)), ((2, 2, 3, 16), (2, 1, 0, 16))],
    ids=["no-batch", "no-query", "no-key"],
)
def test_empty_sizes_give_empty_or_fully_masked_results(name, q_shape, kv_shape):
    """As SDPA: no batch or no query gives empty outputs; no key makes every row fully masked."""
    backend = attnzoo.get(name)
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    if backend.not_supported_reasons(q, k, v):
        pytest.skip("not supported here")
    o, lse = backend.forward(q, k, v, causal=True)
    dq, dk, dv = backend.backward(torch.randn_like(q), q, k, v, o, lse, causal=True)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and dq.shape == q.shape and dk.shape == k.shape
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk)) and dv.abs().sum() == 0
