"""GPU tests of the Triton kernels with SPEC.md's score modifiers (``pytest -m gpu``; skipped without CUDA): sliding
windows, the soft cap, ALiBi and a value head dim Dv != D, alone and together, in float16, bfloat16 and float32;
every candidate config of every kernel on a windowed, soft-capped ALiBi call; the debug tile counts on the GPU.

Shapes are small enough for the CPU float64 oracle, which judges by SPEC.md's rule (as ``test_gpu.py``'s small
checks do).  The Gluon forward applies windows, the soft cap and ALiBi, and takes a head dim in two column parts
(D = 192 with Dv = 128): tests below call it directly.  The Gluon dK/dV kernel applies sliding windows, the soft cap
and ALiBi (checked below with each of its configs pinned, in the two-kernel and the five-product backwards); with
seqlens_k its ``gluon`` configs run the Triton kernel with the same tiles (``GluonScope.not_supported_reasons``),
which the candidate test checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from every_candidate import SHARDS, check_every_candidate
from triton.runtime.errors import OutOfResources

import attnzoo
from attnzoo import debug, oracle
from attnzoo.kernels import forward_gluon
from attnzoo.kernels.forward_gluon import attention_forward_hopper
from attnzoo.kernels.gluon_hopper import gluon_unavailable_reason
from attnzoo.kernels.launch import KernelVariant, prepare
from attnzoo.kernels.tuning import CANDIDATES, candidates, head_dim_tile
from attnzoo.testing import AttentionInputs, oracle_for
from attnzoo.validation import validate_forward

pytestmark = pytest.mark.gpu

CUDA = "cuda"
TRITON = ("triton_2kernel", "triton_atomic")
NAMES = ("o", "lse", "dq", "dk", "dv")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _make(B, H, Hkv, Nq, Nk, D, Dv, dtype, seqlens=None, alibi=None, seed=0):
    """q, k, v, do, seqlens_k, alibi_slopes on the GPU; ``alibi``: None, "heads" ([H]) or "batch-heads" ([B, H])."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(B, H, Nq, D, device=CUDA, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Nk, D, device=CUDA, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv, device=CUDA, dtype=dtype, generator=g)
    do = torch.randn(B, H, Nq, Dv, device=CUDA, dtype=dtype, generator=g)
    sl = None if seqlens is None else torch.tensor(seqlens, device=CUDA, dtype=torch.int32)
    slopes = None
    if alibi is not None:
        # BLOOM's slopes 2^(-8 h / H), per batch scaled so that the two shapes differ.
        base = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device=CUDA)
        slopes = base if alibi == "heads" else base * torch.linspace(0.5, 1.5, B, device=CUDA)[:, None]
    return q, k, v, do, sl, slopes


def _check(outputs, q, k, v, do, **kw):
    """Five outputs against the CPU float64 oracle under SPEC.md's rule (with the contract's stored-o term)."""
    ref = oracle.reference(q, k, v, do, **kw)
    base = oracle.plain_torch(q, k, v, do, **kw) if q.dtype in oracle.LOW_PRECISION else None
    contract = oracle.contract_errors(q, k, v, do, ref, stored_o=outputs[0], **kw)
    for name, got in zip(NAMES, outputs, strict=True):
        assert not torch.isnan(got).any(), f"{name}: NaN"
        baseline = None if base is None else getattr(base, name)
        check = oracle.check_output(name, got, getattr(ref, name), baseline, q.dtype, contract.get(name, 0.0))
        assert check.ok, f"{name}: {check.message}"


def _run(backend, q, k, v, do, **kw):
    o, lse = backend.forward(q, k, v, **kw)
    return (o, lse, *backend.backward(do, q, k, v, o, lse, **kw))


# (B, H, Hkv, Nq, Nk, D, Dv, causal, seqlens_k, window, softcap, alibi)
CASES = {
    "sliding-window": (2, 4, 2, 300, 300, 128, 128, True, None, (64, 0), 0.0, None),
    "window-both-sides-Nq<Nk": (2, 2, 1, 200, 333, 64, 64, False, [333, 150], (40, 25), 0.0, None),
    "window-off-diagonal-empty-rows": (1, 2, 2, 257, 190, 64, 64, False, [170], (None, -100), 0.0, None),
    "empty-band": (1, 2, 1, 130, 130, 64, 64, True, None, (-5, None), 0.0, None),
    "softcap": (2, 4, 4, 250, 250, 128, 128, True, [250, 99], None, 20.0, None),
    "alibi-heads": (2, 4, 2, 220, 300, 64, 64, True, None, None, 0.0, "heads"),
    "alibi-batch-heads": (2, 2, 1, 199, 199, 128, 128, False, [199, 57], (80, 80), 0.0, "batch-heads"),
    "Dv-128-D-192": (1, 4, 2, 260, 260, 192, 128, True, None, None, 0.0, None),
    # Windows above D = 128 (the head-dim-split Gluon backward kernels and the D = 256 Gluon forward take them).
    "window-Dv-128-D-192": (2, 4, 2, 300, 300, 192, 128, True, None, (64, 0), 0.0, None),
    "window-both-sides-D-256": (1, 2, 1, 333, 400, 256, 256, False, None, (50, 70), 0.0, None),
    "Dv-128-D-64": (2, 2, 1, 200, 230, 64, 128, True, [230, 31], (50, 0), 0.0, None),
    "everything": (2, 4, 2, 280, 310, 96, 80, True, [310, 120], (70, -3), 15.0, "batch-heads"),
    # No seqlens_k: the forward runs the Gluon kernel (in bfloat16 with the softmax's max fixed at the cap) and the
    # backward recomputes P with the Triton kernels' tanh from that forward's lse.
    "softcap-gluon-forward": (2, 4, 2, 384, 384, 128, 128, True, None, None, 30.0, None),
    "small-softcap-gluon-forward": (1, 4, 4, 256, 300, 64, 64, False, None, (100, 20), 2.0, None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", TRITON)
def test_score_modifiers_match_the_oracle(name, case, dtype):
    B, H, Hkv, Nq, Nk, D, Dv, causal, seqlens, window, softcap, alibi = CASES[case]
    q, k, v, do, sl, slopes = _make(B, H, Hkv, Nq, Nk, D, Dv, dtype, seqlens, alibi, seed=len(case))
    kw = dict(causal=causal, seqlens_k=sl, window=window, softcap=softcap, alibi_slopes=slopes)
    outputs = _run(attnzoo.get(name), q, k, v, do, **kw)
    _check(outputs, q, k, v, do, **kw)
    if case == "empty-band":
        o, lse, dq, dk, dv = outputs
        assert not o.any() and torch.isneginf(lse).all() and not dq.any() and not dk.any() and not dv.any()


# A head dim that is not a power of two (q/k's columns masked) with a narrower value head dim, v a view whose rows
# are not 16-element aligned: (D, Dv, row width of v's memory, first column). Triton 3.6 compiled these wrong with a
# v tile narrower than q/k's (``launch.value_tile_width``).  do is such a view too (with v's rows aligned, the first
# case, the call keeps the narrow tile and the backward copies do: ``launch.aligned_value_rows``).
NARROW_VALUE_VIEWS = [
    (40, 32, 32, 0),
    (40, 32, 40, 0),
    (40, 32, 48, 3),
    (40, 16, 24, 0),
    (40, 8, 8, 0),
    (24, 16, 24, 0),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("view", NARROW_VALUE_VIEWS, ids=str)
@pytest.mark.parametrize("name", TRITON)
def test_a_narrow_value_head_dim_read_through_a_strided_view(name, view, dtype):
    D, Dv, width, first = view
    q, k, _, _, _, _ = _make(2, 4, 2, 300, 333, D, Dv, dtype, seed=D + Dv)
    g = torch.Generator(device=CUDA).manual_seed(width + first)
    v = torch.randn(2, 2, 333, width + first, device=CUDA, dtype=dtype, generator=g)[..., first : first + Dv]
    do = torch.randn(2, 4, 300, Dv + 11, device=CUDA, dtype=dtype, generator=g)[..., 3 : 3 + Dv]
    outputs = _run(attnzoo.get(name), q, k, v, do, causal=True)
    _check(outputs, q, k, v, do, causal=True)


# (B, H, Hkv, Nq, Nk, D, causal, window): the left edge alone (causal), both edges, a right edge left of the
# diagonal (rows that see no key; with causal too), Nq != Nk both ways, tails, GQA.
GLUON_DKDV_WINDOWS = [
    (2, 4, 2, 300, 300, 128, True, (64, 0)),
    (1, 4, 1, 200, 333, 64, False, (40, 25)),
    (2, 2, 2, 257, 190, 128, False, (None, -70)),
    (1, 2, 1, 333, 200, 64, True, (150, 0)),
    (1, 4, 4, 129, 129, 128, False, (100, None)),
    (1, 2, 2, 190, 230, 64, True, (50, -20)),  # causal with a right edge left of the diagonal: both right bounds
]


# The backwards that run the Gluon dK/dV kernel: (backend, its options, the kernel name its configs pin, the variant)
GLUON_DKDV_BACKWARDS = {
    "two-kernel": ("triton_2kernel", {}, "dkdv", KernelVariant.DKDV),
    "five-product": ("triton_atomic", {}, "atomic", KernelVariant.ATOMIC_PREPROCESS),
    "five-product-ordered": ("triton_atomic", {"deterministic": True}, "atomic", KernelVariant.ATOMIC_ORDERED),
}
# Each of them with every Gluon config of the kernel it pins.
GLUON_DKDV_CONFIGS = [
    (backward, cfg)
    for backward, (_, _, kernel, _) in GLUON_DKDV_BACKWARDS.items()
    for cfg in CANDIDATES[kernel]
    if cfg.gluon
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("backward", "cfg"), GLUON_DKDV_CONFIGS, ids=str)
def test_gluon_dkdv_applies_sliding_windows(backward, cfg, dtype):
    """The Gluon dK/dV kernel, pinned, on windowed calls (the launch layer sends them to it, not to its Triton twin),
    in the two-kernel backward and in the five-product one (dQ added atomically, in any or a fixed order): all five
    outputs within SPEC.md's bound of the float64 oracle, every element written."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    name, options, kernel, variant = GLUON_DKDV_BACKWARDS[backward]
    backend = attnzoo.get(name, configs={kernel: cfg}, **options)
    for B, H, Hkv, Nq, Nk, D, causal, window in GLUON_DKDV_WINDOWS:
        q, k, v, do, _, _ = _make(B, H, Hkv, Nq, Nk, D, D, dtype, seed=Nq + Nk)
        call = prepare(q, k, v, validate_forward(q, k, v, causal=causal, window=window))
        reasons = call.gluon_reasons(variant, do)
        assert not reasons, reasons
        kw = dict(causal=causal, window=window)
        _check(_run(backend, q, k, v, do, **kw), q, k, v, do, **kw)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


# (B, H, Hkv, Nq, Nk, D, causal, window, softcap, slopes): causal and not, slopes per head and per (batch, head)
# with grouped query heads (each head of a group its own slope), Nq != Nk both ways, tails, soft caps small enough to
# bend most scores, a window beside them.
GLUON_DKDV_MODIFIERS = [
    (2, 4, 2, 300, 300, 128, True, None, 0.0, "heads"),
    (2, 4, 1, 200, 333, 64, False, None, 0.0, "batch-heads"),
    (1, 2, 2, 333, 200, 128, True, None, 0.0, "batch-heads"),
    (2, 2, 1, 257, 190, 64, False, (40, 25), 0.0, "heads"),
    (1, 4, 2, 190, 230, 128, True, (60, 0), 0.0, "batch-heads"),
    (2, 4, 2, 300, 300, 128, True, None, 2.0, None),
    (1, 4, 1, 200, 333, 64, False, None, 5.0, None),
    (2, 2, 2, 257, 190, 128, False, (40, 25), 3.0, "batch-heads"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("backward", "cfg"), GLUON_DKDV_CONFIGS, ids=str)
def test_gluon_dkdv_applies_alibi_and_the_soft_cap(backward, cfg, dtype):
    """The Gluon dK/dV kernel, pinned, on ALiBi and soft-capped calls (alone, together and with a window) in the
    two-kernel and the five-product backwards: all five outputs within SPEC.md's bound of the float64 oracle, every
    element written."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    name, options, kernel, variant = GLUON_DKDV_BACKWARDS[backward]
    backend = attnzoo.get(name, configs={kernel: cfg}, **options)
    for B, H, Hkv, Nq, Nk, D, causal, window, softcap, alibi in GLUON_DKDV_MODIFIERS:
        q, k, v, do, _, slopes = _make(B, H, Hkv, Nq, Nk, D, D, dtype, alibi=alibi, seed=Nq + Nk)
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
        call = prepare(q, k, v, validate_forward(q, k, v, **kw))
        reasons = call.gluon_reasons(variant, do)
        assert not reasons, reasons
        _check(_run(backend, q, k, v, do, **kw), q, k, v, do, **kw)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_backward_applies_causal_alibi_thousands_of_keys_away(D, dtype):
    """With a causal mask the Gluon dQ and dK/dV kernels split ALiBi's ``-slope (i' - j)`` into a keys' term and a
    rows' term that joins lse2, each exact only while small: with rows up to 2300 positions from the keys they see
    and BLOOM's slopes for two heads (2^-4 and 2^-8, whose far keys still weigh in), the two-kernel and the
    five-product backwards stay within SPEC.md's bound of the float64 oracle (Nq = Nk with a tail, and Nq << Nk)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    backends = (
        attnzoo.get("triton_2kernel", configs={"dkdv": "64x64 w4 s2 gluon", "dq": "128x64 w8 s3 gluon"}),
        attnzoo.get("triton_atomic", configs={"atomic": "64x128 w8 s2 gluon"}),
    )
    for Nq, Nk in ((2100, 2100), (150, 2300)):
        q, k, v, do, _, slopes = _make(1, 2, 2, Nq, Nk, D, D, dtype, alibi="heads", seed=Nk)
        kw = dict(causal=True, alibi_slopes=slopes)
        call = prepare(q, k, v, validate_forward(q, k, v, **kw))
        assert not call.gluon_reasons(KernelVariant.DKDV, do)
        assert not call.gluon_reasons(KernelVariant.DQ, do, torch.empty_like(do))  # (do, o)
        assert not call.gluon_reasons(KernelVariant.ATOMIC_PREPROCESS, do)
        for backend in backends:
            _check(_run(backend, q, k, v, do, **kw), q, k, v, do, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["dq"] if c.gluon], ids=str)
def test_gluon_dq_applies_each_modifier(cfg, dtype):
    """The Gluon dQ kernel, pinned, on the windowed, ALiBi and soft-capped calls of the dK/dV tests above (the launch
    layer sends them to it, not to its Triton twin): all five outputs within SPEC.md's bound of the float64 oracle
    (dk and dv from the Delta and lse2 it writes), every element written."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    backend = attnzoo.get("triton_2kernel", configs={"dq": cfg})
    windows = [(*case, 0.0, None) for case in GLUON_DKDV_WINDOWS]
    for B, H, Hkv, Nq, Nk, D, causal, window, softcap, alibi in windows + GLUON_DKDV_MODIFIERS:
        q, k, v, do, _, slopes = _make(B, H, Hkv, Nq, Nk, D, D, dtype, alibi=alibi, seed=Nq + Nk)
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
        call = prepare(q, k, v, validate_forward(q, k, v, **kw))
        reasons = call.gluon_reasons(KernelVariant.DQ, do, torch.empty_like(do))  # (do, o)
        assert not reasons, reasons
        _check(_run(backend, q, k, v, do, **kw), q, k, v, do, **kw)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize(
    "dtype,D,Dv", [(torch.float16, 128, 128), (torch.bfloat16, 64, 64), (torch.bfloat16, 192, 128)]
)
def test_every_candidate_config_is_correct_with_a_window_softcap_and_alibi(dtype, D, Dv, shard):
    """Every autotuning candidate of every kernel (Gluon and TMA ones included: the Gluon ones run their Triton twins
    here) on a causal sliding-window call with a soft cap, ALiBi and seqlens_k, D = 192 with Dv = 128 (the tiles of
    256 columns) included (or cannot launch: OutOfResources, which the tuner skips; those are printed)."""
    q, k, v, do, sl, slopes = _make(2, 4, 2, 300, 333, D, Dv, dtype, [333, 100], "heads", seed=D)
    kw = dict(causal=True, seqlens_k=sl, window=(90, 0), softcap=10.0, alibi_slopes=slopes)
    out_of_resources = check_every_candidate(
        q, k, v, do, lambda outputs: _check(outputs, q, k, v, do, **kw), shard, **kw
    )
    print(f"\n[modifier configs] {dtype} D={D} Dv={Dv} out of resources: {out_of_resources}")


# (B, H, Hkv, Nq, Nk, causal, seqlens_k, window)
COUNTED = [
    (1, 2, 1, 1000, 1000, True, None, (256, 0)),
    (2, 2, 2, 700, 900, False, [900, 333], (100, 150)),
    (1, 1, 1, 640, 640, True, None, (-10, None)),
    (1, 2, 1, 513, 300, False, None, (None, -64)),
]


@pytest.mark.parametrize("geometry", COUNTED)
@pytest.mark.parametrize(
    "backend,kernel",
    [("triton_2kernel", "forward"), ("triton_2kernel", "dq"), ("triton_2kernel", "dkdv"), ("triton_atomic", "atomic")],
)
def test_window_skip_counts_on_the_gpu(geometry, backend, kernel):
    """The debug counters of the compiled kernels (64 x 64 tiles) against the tiles of SPEC.md's mask: a tile is
    loaded iff some real row sees some real key in it."""
    B, H, Hkv, Nq, Nk, causal, seqlens, window = geometry
    q, k, v, _, sl, _ = _make(B, H, Hkv, Nq, Nk, 64, 64, torch.float16, seqlens)
    counts = debug.tile_counts(backend, q, k, v, causal, sl, kernel=kernel, window=window)
    bm, bn = counts.block_m, counts.block_n
    mask = oracle.visible_mask(B, Nq, Nk, causal, None if sl is None else sl.cpu(), window=window)[:, 0]
    n_m, n_n = math.ceil(Nq / bm), math.ceil(Nk / bn)
    tiles = torch.zeros(B, n_m, n_n, dtype=torch.int32)
    for i in range(n_m):
        for j in range(n_n):
            tiles[:, i, j] = mask[:, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].flatten(1).any(1).int()
    if kernel == "dkdv":
        visited = (tiles.sum(1) * (H // Hkv))[:, None, :].expand(B, Hkv, n_n)
        total = n_m * (H // Hkv)
    else:
        visited = tiles.sum(2)[:, None, :].expand(B, H, n_m)
        total = n_n
    assert torch.equal(counts.visited, visited.to(counts.visited.dtype))
    assert torch.equal(counts.skipped, (total - visited).to(counts.skipped.dtype))


def _run_gluon_forward(cfg, call, o, lse, causal):
    """The Gluon forward kernel itself on a prepared call, with every field of the tuning config (persistent too)."""
    attention_forward_hopper(
        call.q, call.k, call.v, o, lse, call.scale, causal, call.modifiers, cfg.block_m, cfg.block_n, cfg.num_warps,
        cfg.num_stages, persistent=cfg.persistent,
    )  # fmt: skip


# (Nq, Nk, D, window, softcap, alibi): the Gluon forward's own modifier paths, without seqlens_k (which its scope
# leaves to forward.py), so that each case reaches the Gluon kernel.
GLUON_MODIFIER_CASES = [
    (300, 300, 128, (64, 0), 0.0, None),
    (257, 390, 64, (100, 20), 0.0, "heads"),
    (256, 256, 128, None, 30.0, None),
    (200, 333, 64, (70, 0), 5.0, "batch-heads"),
    (190, 260, 128, (90, 10), 40.0, None),  # above FIXED_MAX_CAP_OUT: bfloat16 keeps the running max
]


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_forward_applies_each_modifier_it_implements(cfg, dtype):
    """The Gluon forward kernel itself (called directly, whatever ``GluonScope`` routes to it) with windows, the soft
    cap and ALiBi, alone and together: o and lse within SPEC.md's bound of the float64 oracle."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    for causal in (False, True):
        for Nq, Nk, D, window, softcap, alibi in GLUON_MODIFIER_CASES:
            q, k, v, _, _, slopes = _make(2, 4, 2, Nq, Nk, D, D, dtype, None, alibi, seed=Nq + D)
            kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
            call = prepare(q, k, v, validate_forward(q, k, v, **kw))
            o = torch.full((2, 4, Nq, D), float("nan"), device=CUDA, dtype=dtype)
            lse = torch.full((2, 4, Nq), float("nan"), device=CUDA)
            _run_gluon_forward(cfg, call, o, lse, causal)
            inputs = AttentionInputs(q, k, v, None, None, slopes)
            checks = oracle_for(inputs, causal, window=window, softcap=softcap, device=CUDA).check({"o": o, "lse": lse})
            for name, check in checks.items():
                assert check.ok, f"{cfg} {dtype} causal={causal} N={Nq}x{Nk} D={D} {kw}: {name}: {check.message}"


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
@pytest.mark.parametrize("cap", [30.0, 33.2], ids=lambda c: f"c{c:g}")  # 33.2: cap_out 47.9, at FIXED_MAX_CAP_OUT
def test_gluon_forward_with_the_max_fixed_at_the_cap_keeps_rows_whose_scores_sit_far_below_it(cfg, cap):
    """bfloat16 with the soft cap takes the softmax's max as the cap itself (``_capped_softmax_step``), so rows whose
    scores all sit far below the cap take every p far below 1: o and lse within SPEC.md's bound of the float64
    oracle for rows with every capped score near -c (p near e^(-2c), 2^-95.8 at c = 33.2), rows with scores near
    -0.7c that still differ (p near 2^-73 to 2^-81, in ratios e^(+-1)), and rows near +0.7c (p near 1)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    q, k, v, _, _, _ = _make(2, 4, 2, 320, 300, 128, 128, torch.bfloat16, seed=86)
    # A shared direction of 32 columns (k's -1, q's a): q . k * scale = -2.83 a, against a random part of about +-1.
    # Rows 0-79: s = -3.4c (tanh -0.998); rows 80-159: s = -0.85c (tanh -0.69, slope 0.52); the rest: s = +0.85c.
    k[..., :32] = -1.0
    q[:, :, :80, :32], q[:, :, 80:160, :32], q[:, :, 160:, :32] = 1.2 * cap, 0.3 * cap, -0.3 * cap
    for causal in (False, True):
        call = prepare(q, k, v, validate_forward(q, k, v, causal=causal, softcap=cap))
        assert forward_gluon.softcap_form(call.modifiers, q.dtype) == forward_gluon.SOFTCAP_FIXED_MAX
        o = torch.full((2, 4, 320, 128), float("nan"), device=CUDA, dtype=q.dtype)
        lse = torch.full((2, 4, 320), float("nan"), device=CUDA)
        _run_gluon_forward(cfg, call, o, lse, causal)
        assert float(lse[:, :, :80].max()) < 7.0 - cap, "the first rows' scores must all sit near -c for this to test"
        inputs = AttentionInputs(q, k, v, None, None, None)
        checks = oracle_for(inputs, causal, softcap=cap, device=CUDA).check({"o": o, "lse": lse})
        for name, check in checks.items():
            assert check.ok, f"{cfg} c={cap} causal={causal}: {name}: {check.message}"


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_forward_with_a_soft_cap_keeps_a_nan_in_k_on_the_rows_that_see_it(cfg, dtype):
    """SPEC.md: a NaN in k reaches every row that sees its key as NaN (o and lse), and no other row, under the soft
    cap's running max (float16) and its fixed max (bfloat16), at an even and at an odd key."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    for key in (36, 37):
        q, k, v, _, _, _ = _make(1, 2, 1, 256, 256, 128, 128, dtype, None, None, seed=key)
        k[0, 0, key, 5] = float("nan")
        call = prepare(q, k, v, validate_forward(q, k, v, causal=True, softcap=30.0))
        o = torch.full((1, 2, 256, 128), float("nan"), device=CUDA, dtype=dtype)
        lse = torch.full((1, 2, 256), float("nan"), device=CUDA)
        _run_gluon_forward(cfg, call, o, lse, True)
        touched = (torch.arange(256, device=CUDA) >= key).expand(1, 2, 256)  # causal: rows at or after the key
        assert torch.equal(lse.isnan(), touched), f"{cfg} {dtype} key {key}: lse is not NaN exactly where touched"
        assert bool(o.isnan().all(dim=-1)[touched].all()) and not o[~touched].isnan().any(), f"{cfg} key {key}: o"


# (Nq, Nk, D, Dv, causal, window, softcap, alibi): head dims that are not a power of two reach the Gluon forward's
# tiles as two column parts (192 = 128 + 64, 96 = 64 + 32), with tails on both sides and every modifier once; a Dv
# other than the first part's width (128/64, 64/128, 96/128) sends O through shared-memory rows of its own.
SPLIT_HEAD_DIM_CASES = [
    (300, 300, 192, 128, False, None, 0.0, None),
    (257, 390, 192, 128, True, None, 0.0, None),
    (200, 333, 192, 128, True, (70, 0), 20.0, "heads"),
    (129, 77, 96, 64, False, None, 0.0, None),
    (190, 250, 128, 64, True, None, 0.0, None),
    (250, 190, 64, 128, False, (30, 40), 0.0, "batch-heads"),
    (100, 300, 96, 128, True, None, 5.0, None),
]


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_forward_takes_a_head_dim_in_two_parts(cfg, dtype):
    """The Gluon forward kernel itself with D = 192, Dv = 128 (DeepSeek's MLA) and D = 96, Dv = 64: S = Q K^T as two
    chained products over the column parts; o and lse within SPEC.md's bound of the float64 oracle.  A config whose
    tiles do not fit the shared memory (OutOfResources, which the tuner skips) must be one the tuner's estimate drops
    too."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    for Nq, Nk, D, Dv, causal, window, softcap, alibi in SPLIT_HEAD_DIM_CASES:
        fits = cfg in candidates("forward", head_dim_tile(D), dtype, torch.device(CUDA), gluon_head_dims=(D, Dv))
        q, k, v, _, _, slopes = _make(2, 4, 2, Nq, Nk, D, Dv, dtype, None, alibi, seed=Nq + D)
        kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
        call = prepare(q, k, v, validate_forward(q, k, v, **kw))
        o = torch.full((2, 4, Nq, Dv), float("nan"), device=CUDA, dtype=dtype)
        lse = torch.full((2, 4, Nq), float("nan"), device=CUDA)
        try:
            _run_gluon_forward(cfg, call, o, lse, causal)
        except OutOfResources as error:
            assert not fits, f"{cfg} D={D} Dv={Dv}: the tuner's estimate keeps a config that does not fit ({error})"
            continue
        inputs = AttentionInputs(q, k, v, None, None, slopes)
        checks = oracle_for(inputs, causal, window=window, softcap=softcap, device=CUDA).check({"o": o, "lse": lse})
        for name, check in checks.items():
            assert check.ok, f"{cfg} {dtype} N={Nq}x{Nk} D={D} Dv={Dv} {kw}: {name}: {check.message}"
