"""Shared test vocabulary: random attention cases, what SPEC.md requires of each backend, and its error rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.backend import REQUIRED_FEATURES, interpreter_unusable_reason, triton_interpreter_active
from attnzoo.validation import lse_dtype

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
LOW_PRECISION = oracle.LOW_PRECISION

# SPEC.md, "Names" and "Dtypes": float64 on the reference backends, float32/float16/bfloat16 on every backend.
REFERENCE_BACKENDS = ("numpy_ref", "torch_fa1", "torch_fa2")
TRITON_BACKENDS = ("triton_atomic", "triton_2kernel")
SPEC_DEVICES = {"numpy_ref": {"cpu"}, "torch_fa1": {"cpu", "cuda"}, "torch_fa2": {"cpu", "cuda"}}
SPEC_DTYPES = {name: {F64, F32, F16, BF16} for name in REFERENCE_BACKENDS}
for _name in TRITON_BACKENDS:
    SPEC_DEVICES[_name] = {"cuda", "cpu"}  # CPU only through the Triton interpreter
    SPEC_DTYPES[_name] = {F32, F16, BF16}
SPEC_MIN_HEAD_DIM_LIMIT = {name: 256 for name in TRITON_BACKENDS}


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, mask, dtype, memory layout and scale."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    seqlens_k: tuple[int, ...] | None
    dtype: torch.dtype
    layout: str  # "contiguous", "bnhd" (transposed view), "padded" (slice of a wider tensor), "broadcast" (stride 0)
    scale: float | None
    seed: int

    def make(self, device: str = "cpu") -> dict:
        """Fresh random inputs for this case (never zeros), laid out as ``layout`` says."""
        gen = torch.Generator().manual_seed(self.seed)

        def rand(b, h, n, d):
            if self.layout == "bnhd":  # [B, N, H, D] memory, viewed as [B, H, N, D]
                x = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).transpose(1, 2)
            elif self.layout == "padded":  # every row has 8 extra elements the kernel must not read
                x = torch.randn(b, h, n, d + 8, generator=gen, dtype=torch.float64)[..., 3 : 3 + d]
            elif self.layout == "broadcast":  # one head expanded over all heads: head stride 0
                x = torch.randn(b, 1, n, d, generator=gen, dtype=torch.float64).expand(b, h, n, d)
            else:
                x = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
            return x.to(device=device, dtype=self.dtype)

        q = rand(self.batch, self.heads, self.seqlen_q, self.head_dim)
        k = rand(self.batch, self.kv_heads, self.seqlen_k, self.head_dim)
        v = rand(self.batch, self.kv_heads, self.seqlen_k, self.head_dim)
        do = rand(self.batch, self.heads, self.seqlen_q, self.head_dim)
        seqlens = None if self.seqlens_k is None else torch.tensor(self.seqlens_k, dtype=torch.int32, device=device)
        return dict(q=q, k=k, v=v, do=do, seqlens_k=seqlens)

    @property
    def mask_kwargs(self) -> dict:
        return dict(causal=self.causal, scale=self.scale)


_EDGE_SEQLENS = (1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 33, 63, 64, 65, 97, 128, 129)
_EDGE_HEAD_DIMS = (8, 16, 32, 40, 64, 80, 96, 128, 256)


def _sizes(edges: tuple[int, ...], largest: int) -> st.SearchStrategy[int]:
    """Sizes up to ``largest``: often an edge (1, primes, around powers of two), otherwise any."""
    return st.one_of(st.sampled_from([n for n in edges if n <= largest]), st.integers(1, largest))


@st.composite
def cases(draw, dtypes=(F64, F32, F16, BF16), max_seqlen: int = 140, max_head_dim: int = 256) -> Case:
    """Random cases: sizes of 1, primes and non-multiples of any block, GQA/MQA, masks, layouts and scales."""
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    batch = draw(st.integers(1, 3))
    seqlen_q = draw(_sizes(_EDGE_SEQLENS, max_seqlen))
    seqlen_k = draw(st.one_of(st.just(seqlen_q), _sizes(_EDGE_SEQLENS, max_seqlen)))
    head_dim = draw(_sizes(_EDGE_HEAD_DIMS, max_head_dim))
    seqlens = None
    if draw(st.booleans()):
        edge = st.sampled_from([0, seqlen_k, max(seqlen_k - 1, 0), 1])
        seqlens = tuple(draw(st.one_of(edge, st.integers(0, seqlen_k))) for _ in range(batch))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.5), st.floats(-1.0, -0.05)))
    return Case(
        batch=batch,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=head_dim,
        causal=draw(st.booleans()),
        seqlens_k=seqlens,
        dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(["contiguous", "contiguous", "bnhd", "padded", "broadcast"])),
        scale=scale,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def spec_requires(backend_name: str, problem: attnzoo.Problem) -> bool:
    """Whether SPEC.md requires ``backend_name`` to run this problem (so that declaring it unsupported is a bug)."""
    if backend_name not in SPEC_DTYPES:  # a backend SPEC.md does not name yet: hold it to its own declaration
        caps = attnzoo.get(backend_name).capabilities
        return problem.device in caps.devices and problem.dtype in caps.dtypes
    if problem.device not in SPEC_DEVICES[backend_name] or problem.dtype not in SPEC_DTYPES[backend_name]:
        return False
    if backend_name in TRITON_BACKENDS and problem.device == "cpu":
        # Only through the interpreter, whose bfloat16 tl.dot is wrong in triton 3.6-3.9 (checked on the GPU), and
        # which Triton 3.6 cannot run with NumPy 2.4.
        usable = triton_interpreter_active() and interpreter_unusable_reason() is None
        return usable and problem.dtype != BF16
    return problem.head_dim <= SPEC_MIN_HEAD_DIM_LIMIT.get(backend_name, problem.head_dim)


def backend_features_ok(backend_name: str) -> set[str]:
    """The SPEC.md features a backend fails to declare (empty when it declares them all)."""
    return set(REQUIRED_FEATURES) - set(attnzoo.get(backend_name).capabilities.features)


def assert_close(name: str, got, ref: torch.Tensor, baseline, dtype: torch.dtype, contract_error: float = 0.0) -> float:
    """Check ``got`` against the float64 oracle under SPEC.md's rule; return ``error / bound`` (<= 1 passes)."""
    check = oracle.check_output(name, got, ref, baseline, dtype, contract_error)
    assert check.ok, f"{name}: {check.message} ({dtype})"
    return check.ratio


def run_and_check(backend: attnzoo.Backend, case: Case, device: str = "cpu") -> dict[str, float]:
    """Run forward and backward of ``backend`` on ``case`` and check all five outputs; return error ratios."""
    x = case.make(device)
    kw = dict(causal=case.causal, scale=case.scale, seqlens_k=x["seqlens_k"])
    before = {key: val.clone() for key, val in x.items() if val is not None}
    o, lse = backend.forward(x["q"], x["k"], x["v"], **kw)
    o_before, lse_before = o.clone(), lse.clone()
    dq, dk, dv = backend.backward(x["do"], x["q"], x["k"], x["v"], o, lse, **kw)
    for key, val in before.items():
        assert torch.equal(x[key], val), f"input {key} was modified"
    assert torch.equal(o, o_before) and torch.equal(lse, lse_before), "backward modified its o or lse input"
    assert o.dtype == case.dtype and dq.dtype == case.dtype and dk.dtype == case.dtype and dv.dtype == case.dtype
    assert lse.dtype == lse_dtype(case.dtype) and tuple(lse.shape) == (case.batch, case.heads, case.seqlen_q)
    ref = oracle.reference(x["q"], x["k"], x["v"], x["do"], **kw)
    base = oracle.plain_torch(x["q"], x["k"], x["v"], x["do"], **kw) if case.dtype in LOW_PRECISION else None
    contract = oracle.contract_errors(x["q"], x["k"], x["v"], x["do"], ref, stored_o=o, **kw)
    ratios = {}
    for name, got in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        baseline = None if base is None else getattr(base, name)
        ratios[name] = assert_close(name, got, getattr(ref, name), baseline, case.dtype, contract.get(name, 0.0))
    return ratios
