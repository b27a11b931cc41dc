"""``attnzoo.attention_fp8``: FP8 (e4m3) inputs with descale factors, o in bfloat16.

The judge is the float64 oracle on the real inputs (``descale * x``).  The rule is SPEC.md's for 16-bit outputs with
plain PyTorch's FP8 recipe (``fp8.fp8_recipe``: P rounded to e4m3 before ``P V``) as the baseline: at most twice its
error plus one bfloat16 rounding unit.  The Triton kernels run FP8 on a GPU only (the Triton interpreter rounds
float32 to float8 wrongly), so their cases are marked ``gpu``; the reference backends run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.fp8 import FP8, dequantize, descale_table, fp8_recipe

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _inputs(batch, heads, kv_heads, nq, nk, d, per_head, seed, device):
    """FP8 q, k, v of magnitudes up to a few units (as a per-tensor scaling recipe stores them), and their factors."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        (torch.randn(batch, h, n, d, generator=gen) * 3).to(FP8).to(device)
        for h, n in ((heads, nq), (kv_heads, nk), (kv_heads, nk))
    )
    shape = (batch, kv_heads) if per_head else ()
    factors = [(0.25 + torch.rand(shape, generator=gen)).to(device) for _ in range(3)]
    return q, k, v, factors


def _check(backend, q, k, v, factors, causal):
    o, lse = attnzoo.attention_fp8(q, k, v, *factors, causal=causal, backend=backend, return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == (*q.shape[:3], v.shape[3]) and lse.dtype == torch.float32
    batch, kv_heads, d = k.shape[0], k.shape[1], q.shape[3]
    table = descale_table(*factors, batch, kv_heads, q.device)
    real = dequantize(q, k, v, table, torch.float64)
    ref = oracle.reference(*real, causal=causal, device=q.device)
    base_o, base_lse = fp8_recipe(q, k, v, table, causal, d**-0.5)
    for name, got, want, base in (("o", o, ref.o, base_o), ("lse", lse, ref.lse.double(), base_lse)):
        check = oracle.check_output(name, got, want, base, torch.bfloat16)
        assert check.ok, f"{name}: {check.message}"


@pytest.mark.parametrize("backend", ["numpy_ref", "torch_fa1", "torch_fa2"])
@given(
    shape=st.sampled_from([(1, 2, 1, 33, 40, 16), (2, 4, 2, 17, 17, 32), (1, 1, 1, 1, 70, 8)]),
    causal=st.booleans(),
    per_head=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=8)
def test_reference_backends_attend_the_real_inputs(backend, shape, causal, per_head, seed):
    """The reference backends run their float32 forward on the real inputs: within the rule."""
    q, k, v, factors = _inputs(*shape, per_head, seed, "cpu")
    _check(backend, q, k, v, factors, causal)


def test_bad_input_names_the_argument():
    q, k, v, (_, kd, _) = _inputs(1, 2, 1, 8, 8, 16, True, 0, "cpu")
    cases = [
        ((q.half(), k, v), {}, TypeError, "q must have dtype torch.float8_e4m3fn"),
        ((q, k, v.to(torch.float8_e5m2)), {}, TypeError, "v must have dtype torch.float8_e4m3fn"),
        ((q, k, v), {"k_descale": kd.double()}, TypeError, "k_descale must be float32"),
        ((q, k, v), {"q_descale": 2.0}, TypeError, "q_descale must be a float32 tensor"),
        ((q, k, v), {"v_descale": torch.ones(2, 1)}, ValueError, "v_descale must have shape [] or [B, Hkv]"),
        ((q, k[:, :, :, :8], v), {}, ValueError, "k must have head dim 16"),
        ((q, k, v), {"return_lse": 1}, TypeError, "return_lse must be a bool"),
        ((q, k, v), {"backend": 3}, TypeError, "backend must be a backend name"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
            attnzoo.attention_fp8(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_the_triton_backends_say_why_not_on_the_cpu():
    q, k, v, factors = _inputs(1, 2, 1, 8, 8, 16, False, 0, "cpu")
    for name in ("triton_2kernel", "triton_atomic"):
        with pytest.raises(NotImplementedError, match="FP8 runs on the GPU only"):
            attnzoo.attention_fp8(q, k, v, *factors, backend=name)


# The Triton kernels on the GPU: tails on both sides, one query row, GQA, Nq != Nk, both kinds of factors.
GPU_CASES = [
    (2, 8, 2, 1000, 1000, 128, True),
    (1, 4, 4, 1, 300, 64, False),
    (3, 4, 1, 129, 257, 128, True),
    (1, 16, 16, 2048, 2048, 128, False),
    (2, 2, 2, 77, 64, 64, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="FP8 tensor cores: compute capability 8.9 and later")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("backend", ["triton_2kernel", "triton_atomic"])
def test_triton_fp8_forward_on_the_gpu(backend, case, causal):
    """The FP8 kernel (``kernels/forward.py``, DESCALE) within the rule; o starts as NaN, so unwritten rows fail."""
    *shape, per_head = case
    q, k, v, factors = _inputs(*shape, per_head, sum(shape), "cuda")
    _check(backend, q, k, v, factors, causal)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="FP8 tensor cores: compute capability 8.9 and later")
def test_triton_fp8_takes_v_of_either_layout():
    """v with its head dim contiguous is copied to keys-contiguous for the kernel; the result is the same bits."""
    q, k, v, factors = _inputs(1, 4, 2, 256, 256, 128, True, 9, "cuda")
    keys_contiguous = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    a = attnzoo.attention_fp8(q, k, v, *factors, backend="triton_2kernel")
    b = attnzoo.attention_fp8(q, k, keys_contiguous, *factors, backend="triton_2kernel")
    assert torch.equal(a, b)
