"""Shared test vocabulary: random attention cases, what SPEC.md requires of each backend, and its error rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle, testing
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
    layout: str  # one of attnzoo.testing.LAYOUTS
    scale: float | None
    seed: int

    def make(self, device: str = "cpu") -> testing.AttentionInputs:
        """Fresh random inputs for this case (never zeros), laid out as ``layout`` says."""
        return testing.random_inputs(
            self.batch, self.heads, self.kv_heads, self.seqlen_q, self.seqlen_k, self.head_dim,
            dtype=self.dtype, device=device, seed=self.seed, seqlens_k=self.seqlens_k, layout=self.layout,
        )  # fmt: skip

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


def run_and_check(backend: attnzoo.Backend, case: Case, device: str = "cpu") -> dict[str, float]:
    """Run forward and backward of ``backend`` on ``case`` and check all five outputs; return error ratios."""
    x = case.make(device)
    before = {key: val.clone() for key, val in vars(x).items() if val is not None}
    kw = dict(causal=case.causal, scale=case.scale, seqlens_k=x.seqlens_k)
    o, lse = backend.forward(x.q, x.k, x.v, **kw)
    o_before, lse_before = o.clone(), lse.clone()
    dq, dk, dv = backend.backward(x.do, x.q, x.k, x.v, o, lse, **kw)
    outputs = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    for key, val in before.items():
        assert torch.equal(getattr(x, key), val), f"input {key} was modified"
    assert torch.equal(o, o_before) and torch.equal(lse, lse_before), "backward modified its o or lse input"
    assert all(outputs[name].dtype == case.dtype for name in ("o", "dq", "dk", "dv"))
    assert lse.dtype == lse_dtype(case.dtype) and tuple(lse.shape) == (case.batch, case.heads, case.seqlen_q)
    checks = testing.oracle_for(x, case.causal, case.scale).check(outputs)
    for name, check in checks.items():
        assert check.ok, f"{name}: {check.message} ({case.dtype})"
    return {name: check.ratio for name, check in checks.items()}
