"""Shared test vocabulary: random attention cases, what SPEC.md requires of each backend, and its error rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle, testing
from attnzoo.backend import REQUIRED_FEATURES, interpreter_unusable_reason, triton_interpreter_active
from attnzoo.validation import lse_dtype, validate_forward

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
LOW_PRECISION = oracle.LOW_PRECISION

# SPEC.md, "Names" and "Dtypes": float64 on the reference backends, float32/float16/bfloat16 on every backend.
REFERENCE_BACKENDS = ("numpy_ref", "torch_fa1", "torch_fa2")
TRITON_BACKENDS = ("triton_atomic", "triton_2kernel", "triton_splitk")
SPEC_DEVICES = {"numpy_ref": {"cpu"}, "torch_fa1": {"cpu", "cuda"}, "torch_fa2": {"cpu", "cuda"}}
SPEC_DTYPES = {name: {F64, F32, F16, BF16} for name in REFERENCE_BACKENDS}
for _name in TRITON_BACKENDS:
    SPEC_DEVICES[_name] = {"cuda", "cpu"}  # CPU only through the Triton interpreter
    SPEC_DTYPES[_name] = {F32, F16, BF16}
SPEC_MIN_HEAD_DIM_LIMIT = {name: 256 for name in TRITON_BACKENDS}
# SPEC.md features a backend may still lack, tracked here so that nothing else goes missing unnoticed (none now: the
# Triton kernels gained issue 25's score modifiers and Dv != D).  A backend must declare every required feature
# except these; once it declares one of them, the test of declarations fails until the entry here goes, and from
# then on the property suite requires the feature of it.
SPEC_PENDING_FEATURES: dict[str, set[str]] = {}


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, masks, score modifiers, dtype, memory layout and scale.

    ``head_dim_v`` None: as ``head_dim``.  ``alibi``: "none", "heads" (slopes ``[H]``) or "batch-heads" (``[B, H]``).
    """

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
    window: tuple[int | None, int | None] | None = None
    softcap: float = 0.0
    alibi: str = "none"
    head_dim_v: int | None = None

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def modifiers(self) -> set[str]:
        """The score modifiers (and Dv != D) this case uses, named as in ``Capabilities.features``."""
        used = {
            "window": self.window is not None,
            "softcap": self.softcap != 0.0,
            "alibi": self.alibi != "none",
            "head_dim_v": self.dv != self.head_dim,
        }
        return {name for name, on in used.items() if on}

    def make(self, device: str = "cpu") -> testing.AttentionInputs:
        """Fresh random inputs for this case (never zeros), laid out as ``layout`` says."""
        return testing.random_inputs(
            self.batch, self.heads, self.kv_heads, self.seqlen_q, self.seqlen_k, self.head_dim,
            dtype=self.dtype, device=device, seed=self.seed, seqlens_k=self.seqlens_k, layout=self.layout,
            head_dim_v=self.dv, alibi=self.alibi,
        )  # fmt: skip

    def call_kwargs(self, x: testing.AttentionInputs) -> dict:
        """The keyword arguments of forward/backward (and of the oracle) for inputs ``x`` made by :meth:`make`."""
        return dict(
            causal=self.causal,
            scale=self.scale,
            seqlens_k=x.seqlens_k,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=x.alibi_slopes,
        )


_EDGE_SEQLENS = (1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 33, 63, 64, 65, 97, 128, 129)
_EDGE_HEAD_DIMS = (8, 16, 32, 40, 64, 80, 96, 128, 256)


def _sizes(edges: tuple[int, ...], largest: int) -> st.SearchStrategy[int]:
    """Sizes up to ``largest``: often an edge (1, primes, around powers of two), otherwise any."""
    return st.one_of(st.sampled_from([n for n in edges if n <= largest]), st.integers(1, largest))


def _window_side(seqlen: int) -> st.SearchStrategy[int | None]:
    """One side of a window: unbounded, an edge (0, +-1, +-N, beyond N, far beyond), or any int around N."""
    edges = st.sampled_from([0, 1, -1, 2, seqlen, -seqlen, seqlen + 9, -(seqlen + 9), 2**40, -(2**40)])
    return st.one_of(st.none(), edges, st.integers(-seqlen - 5, seqlen + 5))


# Soft caps from tiny (every score squashed to about +-softcap) to large (almost the identity).  A cap c multiplies
# a score's rounding error by 1/c in the backward (the derivative 1 - tanh^2(S / c)): float32's fixed tolerance holds
# for caps from 0.05 on (a float32 reference backend missed it by 2x at c = 1e-3, as ill-conditioned as plain PyTorch
# there); tinier caps are checked in float64 (exact) and in float16/bfloat16 (against plain PyTorch's own error).
_SOFTCAPS = st.one_of(st.sampled_from([1e-3, 0.05, 1.0, 5.0, 30.0, 1e4]), st.floats(1e-3, 1e4))
_FLOAT32_SOFTCAPS = st.one_of(st.sampled_from([0.05, 1.0, 5.0, 30.0, 1e4]), st.floats(0.05, 1e4))


@st.composite
def cases(
    draw,
    dtypes=(F64, F32, F16, BF16),
    max_seqlen: int = 140,
    max_head_dim: int = 256,
    features: frozenset[str] = REQUIRED_FEATURES,
) -> Case:
    """Random cases: sizes of 1, primes and non-multiples of any block, GQA/MQA, masks, layouts and scales, and the
    score modifiers in ``features`` (windows empty, one-sided, negative or wider than N; soft caps tiny to large;
    ALiBi slopes of both shapes; Dv from 1 to ``max_head_dim``), each on in about half the cases."""
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
    window = softcap = head_dim_v = None
    if "window" in features and draw(st.booleans()):
        window = (draw(_window_side(seqlen_k)), draw(_window_side(seqlen_k)))
    dtype = draw(st.sampled_from(dtypes))
    if "softcap" in features and draw(st.booleans()):
        softcap = draw(_FLOAT32_SOFTCAPS if dtype == F32 else _SOFTCAPS)
    alibi = draw(st.sampled_from(["none", "heads", "batch-heads"])) if "alibi" in features else "none"
    if "head_dim_v" in features and draw(st.booleans()):
        head_dim_v = draw(st.one_of(st.just(1), _sizes(_EDGE_HEAD_DIMS, max_head_dim)))
    return Case(
        batch=batch,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=head_dim,
        causal=draw(st.booleans()),
        seqlens_k=seqlens,
        dtype=dtype,
        layout=draw(st.sampled_from(["contiguous", "contiguous", "bnhd", "padded", "broadcast"])),
        scale=scale,
        seed=draw(st.integers(0, 2**31 - 1)),
        window=window,
        softcap=softcap or 0.0,
        alibi=alibi,
        head_dim_v=head_dim_v,
    )


def spec_requires(backend_name: str, problem: attnzoo.Problem) -> bool:
    """Whether SPEC.md requires ``backend_name`` to run this problem (so that declaring it unsupported is a bug)."""
    if backend_name not in SPEC_DTYPES:  # a backend SPEC.md does not name yet: hold it to its own declaration
        caps = attnzoo.get(backend_name).capabilities
        return problem.device in caps.devices and problem.dtype in caps.dtypes
    if problem.device not in SPEC_DEVICES[backend_name] or problem.dtype not in SPEC_DTYPES[backend_name]:
        return False
    declared = attnzoo.get(backend_name).capabilities.features
    if problem.features_used & (SPEC_PENDING_FEATURES.get(backend_name, set()) - declared):
        return False  # a feature still pending for this backend (see SPEC_PENDING_FEATURES)
    on_cpu_triton = backend_name in TRITON_BACKENDS and problem.device == "cpu"
    # Only through the interpreter, whose bfloat16 tl.dot is wrong in triton 3.6-3.9 (checked on the GPU), and
    # which Triton 3.6 cannot run with NumPy 2.4.
    usable = triton_interpreter_active() and interpreter_unusable_reason() is None
    if on_cpu_triton and (not usable or problem.dtype == BF16):
        return False
    limit = SPEC_MIN_HEAD_DIM_LIMIT.get(backend_name)
    return limit is None or max(problem.head_dim, problem.head_dim_v) <= limit


def missing_features(backend_name: str) -> set[str]:
    """The SPEC.md features a backend does not declare (empty when it declares them all)."""
    return set(REQUIRED_FEATURES) - set(attnzoo.get(backend_name).capabilities.features)


def run_and_check(backend: attnzoo.Backend, case: Case, device: str = "cpu") -> dict[str, float]:
    """Run forward and backward of ``backend`` on ``case`` and check all five outputs; return error ratios."""
    x = case.make(device)
    kw = case.call_kwargs(x)
    before = {key: val.clone() for key, val in vars(x).items() if val is not None}
    o, lse = backend.forward(x.q, x.k, x.v, **kw)
    o_before, lse_before = o.clone(), lse.clone()
    dq, dk, dv = backend.backward(x.do, x.q, x.k, x.v, o, lse, **kw)
    outputs = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    for key, val in before.items():
        assert torch.equal(getattr(x, key), val), f"input {key} was modified"
    assert torch.equal(o, o_before) and torch.equal(lse, lse_before), "backward modified its o or lse input"
    assert all(outputs[name].dtype == case.dtype for name in ("o", "dq", "dk", "dv"))
    assert outputs["o"].shape == x.do.shape and outputs["dv"].shape == x.v.shape
    assert lse.dtype == lse_dtype(case.dtype) and tuple(lse.shape) == (case.batch, case.heads, case.seqlen_q)
    judge = testing.oracle_for(x, case.causal, case.scale, window=case.window, softcap=case.softcap)
    checks = judge.check(outputs)
    for name, check in checks.items():
        assert check.ok, f"{name}: {check.message} ({case.dtype})"
    return {name: check.ratio for name, check in checks.items()}


def run_if_supported(backend: attnzoo.Backend, case: Case, device: str) -> bool:
    """Run and check ``case`` if the backend supports it; a refusal must be one SPEC.md allows."""
    x = case.make(device)
    kw = case.call_kwargs(x)
    reasons = backend.not_supported_reasons(x.q, x.k, x.v, **kw)
    if reasons:
        problem = validate_forward(x.q, x.k, x.v, **kw)
        assert not spec_requires(backend.name, problem), f"{backend.name} refuses a case SPEC.md requires: {reasons}"
        return False
    run_and_check(backend, case, device)
    return True
