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
from attnzoo.fp8 import FP8, descale_table, fp8_recipe
from attnzoo.kernels.gluon_hopper import gluon_unavailable_reason
from attnzoo.kernels.launch import KernelVariant, prepare
from attnzoo.kernels.tuning import CANDIDATES
from attnzoo.validation import validate_forward

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _inputs(batch, heads, kv_heads, nq, nk, d, dv, factors, seed, device):
    """FP8 q, k, v of magnitudes up to a few units (as a per-tensor scaling recipe stores them), and their factors:
    "tensor" (0-d, positive), "head" ([B, Hkv], positive), "signed" ([B, Hkv], either sign) or "zero-k" (k's 0)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        (torch.randn(batch, h, n, width, generator=gen) * 3).to(FP8).to(device)
        for h, n, width in ((heads, nq, d), (kv_heads, nk, d), (kv_heads, nk, dv))
    )
    shape = () if factors == "tensor" else (batch, kv_heads)
    values = [0.25 + torch.rand(shape, generator=gen) for _ in range(3)]
    if factors == "signed":
        values = [x * (torch.randint(0, 2, shape, generator=gen) * 2 - 1) for x in values]
    if factors == "zero-k":
        values[1] = torch.zeros(shape)
    return q, k, v, [x.to(device) for x in values]


def _real(x: torch.Tensor, factor: torch.Tensor, group: int) -> torch.Tensor:
    """``factor * x`` in float64, head by head: head ``h`` of ``x`` takes the factor of K/V head ``h // group``."""
    out = x.double().clone()
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            out[b, h] *= float(factor if factor.dim() == 0 else factor[b, h // group])
    return out


def _check(backend, q, k, v, factors, causal, scale=None):
    o, lse = attnzoo.attention_fp8(q, k, v, *factors, causal=causal, scale=scale, backend=backend, return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == (*q.shape[:3], v.shape[3]) and lse.dtype == torch.float32
    group = q.shape[1] // k.shape[1]
    real = (_real(q, factors[0], group), _real(k, factors[1], 1), _real(v, factors[2], 1))
    ref = oracle.reference(*real, causal=causal, scale=scale, device=q.device)
    table = descale_table(*factors, k.shape[0], k.shape[1], q.device)
    base_o, base_lse = fp8_recipe(q, k, v, table, causal, q.shape[3] ** -0.5 if scale is None else scale)
    for name, got, want, base in (("o", o, ref.o, base_o), ("lse", lse, ref.lse.double(), base_lse)):
        check = oracle.check_output(name, got, want, base, torch.bfloat16)
        assert check.ok, f"{name}: {check.message}"


# (B, H, Hkv, Nq, Nk, D, Dv): tails, one query row, GQA, Nq != Nk, D not a power of two, D = 16, Dv != D.
SHAPES = [
    (1, 2, 1, 33, 40, 16, 16),
    (2, 4, 2, 17, 17, 32, 32),
    (1, 1, 1, 1, 70, 8, 8),
    (1, 2, 2, 20, 25, 24, 40),
]
FACTORS = ["tensor", "head", "signed", "zero-k"]


@pytest.mark.parametrize("backend", ["numpy_ref", "torch_fa1", "torch_fa2"])
@given(
    shape=st.sampled_from(SHAPES),
    causal=st.booleans(),
    factors=st.sampled_from(FACTORS),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=10)
def test_reference_backends_attend_the_real_inputs(backend, shape, causal, factors, scale, seed):
    """The reference backends run their float32 forward on the real inputs: within the rule."""
    q, k, v, values = _inputs(*shape, factors, seed, "cpu")
    _check(backend, q, k, v, values, causal, scale)


def test_bad_input_names_the_argument():
    q, k, v, (_, kd, _) = _inputs(1, 2, 1, 8, 8, 16, 16, "head", 0, "cpu")
    cases = [
        ((q.half(), k, v), {}, TypeError, "q must have dtype torch.float8_e4m3fn"),
        ((q, k, v.to(torch.float8_e5m2)), {}, TypeError, "v must have dtype torch.float8_e4m3fn"),
        ((q, k, v), {"k_descale": kd.double()}, TypeError, "k_descale must be float32"),
        ((q, k, v), {"q_descale": 2.0}, TypeError, "q_descale must be a float32 tensor"),
        ((q, k, v), {"v_descale": torch.ones(2, 1)}, ValueError, "v_descale must have shape [] or [B, Hkv]"),
        ((q, k[:, :, :, :8], v), {}, ValueError, "k must have head dim 16"),
        ((q, k, v), {"return_lse": 1}, TypeError, "return_lse must be a bool"),
        ((q, k, v), {"backend": 3}, TypeError, "backend must be a backend name"),
        ((q, k, v), {"q_descale": kd.to_sparse()}, TypeError, "q_descale must be a dense"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
            attnzoo.attention_fp8(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_the_triton_backends_say_why_not_on_the_cpu():
    q, k, v, factors = _inputs(1, 2, 1, 8, 8, 16, 16, "tensor", 0, "cpu")
    for name in ("triton_2kernel", "triton_atomic"):
        with pytest.raises(NotImplementedError, match="FP8 runs on the GPU only"):
            attnzoo.attention_fp8(q, k, v, *factors, backend=name)


def test_auto_picks_a_backend_where_q_is():
    """CPU inputs run a reference backend even where a GPU is present; a descale that requires grad gives no graph."""
    q, k, v, factors = _inputs(1, 2, 1, 8, 8, 16, 16, "head", 0, "cpu")
    factors[0].requires_grad_()
    o = attnzoo.attention_fp8(q, k, v, *factors)
    assert o.device.type == "cpu" and o.grad_fn is None


# The Triton kernels on the GPU, (B, H, Hkv, Nq, Nk, D, Dv, factors): tails on both sides, one query row, GQA,
# Nq != Nk, D = 16 (a tile of 32), D not a power of two, Dv != D, every kind of factor.
GPU_CASES = [
    (2, 8, 2, 1000, 1000, 128, 128, "head"),
    (1, 4, 4, 1, 300, 64, 64, "tensor"),
    (3, 4, 1, 129, 257, 128, 128, "signed"),
    (1, 16, 16, 2048, 2048, 128, 128, "tensor"),
    (2, 2, 2, 77, 64, 64, 64, "zero-k"),
    (1, 2, 1, 100, 130, 16, 16, "head"),
    (2, 4, 2, 200, 190, 80, 80, "signed"),
    (1, 4, 2, 150, 150, 128, 64, "head"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="FP8 tensor cores: compute capability 8.9 and later")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("forward", [None, "64x64 w4 s3", "128x128 w8 s3"], ids=str)
def test_triton_fp8_forward_on_the_gpu(forward, case, causal):
    """The FP8 forward within the rule, as the backend picks its kernel (None) and pinned to tiles of the Triton
    kernel (``kernels/forward.py``, DESCALE); o starts as NaN, so unwritten rows fail."""
    *shape, factors = case
    q, k, v, values = _inputs(*shape, factors, sum(shape), "cuda")
    _check(attnzoo.get("triton_2kernel", configs=forward and {"forward": forward}), q, k, v, values, causal)


# Cases in the Gluon forward's FP8 scope (D = Dv = 64 or 128; Nk a multiple of 16, so that v's keys-contiguous view
# has 16-byte aligned rows for TMA): Q tails, one query row, GQA, Nq != Nk, factors of either sign and zero.
GLUON_CASES = [
    (2, 8, 2, 1000, 1008, 128, 128, "head"),
    (3, 4, 1, 129, 256, 128, 128, "signed"),
    (1, 4, 4, 1, 304, 64, 64, "tensor"),
    (2, 2, 2, 77, 64, 64, 64, "zero-k"),
    (2, 4, 2, 200, 192, 64, 64, "signed"),
]
GLUON_FORWARD = [c for c in CANDIDATES["forward"] if c.gluon and not c.persistent]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="FP8 tensor cores: compute capability 8.9 and later")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GLUON_CASES, ids=str)
@pytest.mark.parametrize("forward", GLUON_FORWARD, ids=str)
def test_gluon_fp8_forward_on_the_gpu(forward, case, causal):
    """Every non-persistent Gluon forward config, pinned, on FP8 inputs (``forward_gluon.py``, DESCALE): within the
    rule, every row written; the launch layer sends each case to the Gluon kernel (a case out of its scope would
    pass on the Triton twin)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    *shape, factors = case
    q, k, v, values = _inputs(*shape, factors, sum(shape) + 1, "cuda")
    v = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # what the kernel reads (else the backend copies it)
    problem = validate_forward(q, k, v, causal, None, fp8=True)
    table = descale_table(*values, problem.batch, problem.kv_heads, q.device)
    reasons = prepare(q, k, v, problem, descale=table).gluon_reasons(KernelVariant.FORWARD)
    assert not reasons, reasons
    _check(attnzoo.get("triton_2kernel", configs={"forward": forward}), q, k, v, values, causal)
    # A Gluon compilation error would have switched the Triton twin in, with a warning only.
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="FP8 tensor cores: compute capability 8.9 and later")
def test_triton_fp8_takes_v_of_either_layout():
    """v with its head dim contiguous is copied to keys-contiguous for the kernel: the same bits as passing that."""
    q, k, v, factors = _inputs(1, 4, 2, 256, 256, 128, 128, "head", 9, "cuda")
    keys_contiguous = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    a = attnzoo.attention_fp8(q, k, v, *factors, backend="triton_2kernel")
    b = attnzoo.attention_fp8(q, k, keys_contiguous, *factors, backend="triton_2kernel")
    assert torch.equal(a, b)
