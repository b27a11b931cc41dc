"""Tests specific to the Triton backends; they run under the interpreter on the CPU (and on CUDA tensors when
a GPU is present): tile counts from the kernels' debug mode against the exact causal/padding geometry, the
``delta`` option of triton_atomic, NaN-free masking, strides, the support declarations and the autotuner's
handling of accumulation buffers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import triton

import attnzoo
from attnzoo import debug, oracle
from attnzoo.backends import _triton_base as triton_base
from attnzoo.backends.triton_atomic import TritonAtomic
from attnzoo.kernels import launch as launch_module
from attnzoo.kernels import tuning
from attnzoo.kernels.forward import attention_forward
from attnzoo.kernels.launch import (
    KernelVariant,
    PreparedCall,
    aligned_value_rows,
    descriptor_loads_possible,
    int32_addressable,
    prepare,
    value_tile_width,
)
from attnzoo.kernels.tuning import Autotuner, KernelConfig
from attnzoo.testing import AttentionInputs, check_backend, random_inputs
from attnzoo.validation import validate_forward

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and attnzoo.backend.interpreter_unusable_reason() is not None,
    reason=str(attnzoo.backend.interpreter_unusable_reason()),
)
# Tensor descriptors (triton.tools.tensor_descriptor) arrived after Triton 3.2; without them `tma` configs load
# through pointers, which these tests cannot tell apart.
needs_descriptors = pytest.mark.skipif(launch_module.TensorDescriptor is None, reason="this Triton has no descriptors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = ("triton_2kernel", "triton_atomic")

# (B, H, Hkv, Nq, Nk, D, causal, seqlens_k): causal with Nq < Nk, Nq > Nk (empty top rows), seqlens_k with 0,
# head dims that are not powers of two, partial last blocks on both sides.
GEOMETRIES = [
    (2, 2, 1, 37, 53, 40, True, [46, 0]),
    (1, 2, 2, 64, 64, 16, True, None),
    (2, 1, 1, 50, 20, 24, True, [20, 7]),
    (1, 4, 1, 33, 70, 16, False, [70]),
    (2, 2, 2, 16, 48, 32, True, [5, 48]),
]


def _inputs(B, H, Hkv, Nq, Nk, D, seqlens, dtype=torch.float32, seed=0):
    x = random_inputs(B, H, Hkv, Nq, Nk, D, dtype=dtype, device=DEVICE, seed=seed, seqlens_k=seqlens)
    return x.q, x.k, x.v, x.do, x.seqlens_k


def _check_all(backend, q, k, v, do, causal, seqlens, scale=None, window=None, softcap=0.0, alibi_slopes=None):
    """Forward and backward of ``backend`` against the float64 oracle under SPEC.md's rule, with the score modifiers
    ``window``, ``softcap`` and ``alibi_slopes``."""
    inputs = AttentionInputs(q, k, v, do, seqlens, alibi_slopes)
    outputs, checks = check_backend(backend, inputs, causal, scale, window=window, softcap=softcap)
    for name, check in checks.items():
        assert check.ok, f"{backend!r} {name}: {check.message}"
    return tuple(outputs[name] for name in ("o", "lse", "dq", "dk", "dv"))


def _expected_q_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn, window=None):
    """Exact K/V tile counts per Q block: a tile is needed iff some real row sees some real key in it (SPEC.md's
    mask, window included)."""
    mask = oracle.visible_mask(B, Nq, Nk, causal, None if seqlens is None else torch.tensor(seqlens), window=window)
    mask = mask[:, 0]
    n_m, n_n = math.ceil(Nq / bm), math.ceil(Nk / bn)
    visited = torch.zeros(B, n_m, dtype=torch.int32)
    for i in range(n_m):
        for j in range(n_n):
            visited[:, i] += mask[:, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].flatten(1).any(1).int()
    visited = visited[:, None, :].expand(B, H, n_m)
    return visited, n_n - visited


def _expected_kv_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn, window=None):
    """Exact Q tile counts per K/V block, summed over the group's query heads."""
    mask = oracle.visible_mask(B, Nq, Nk, causal, None if seqlens is None else torch.tensor(seqlens), window=window)
    mask = mask[:, 0]
    n_m, n_n = math.ceil(Nq / bm), math.ceil(Nk / bn)
    group = H // Hkv
    visited = torch.zeros(B, n_n, dtype=torch.int32)
    for j in range(n_n):
        for i in range(n_m):
            visited[:, j] += mask[:, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].flatten(1).any(1).int()
    visited = (visited * group)[:, None, :].expand(B, Hkv, n_n)
    return visited, n_m * group - visited


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize(
    "backend,kernel", [("triton_2kernel", "forward"), ("triton_2kernel", "dq"), ("triton_atomic", "atomic")]
)
def test_q_stationary_tile_counts_match_geometry(geometry, backend, kernel):
    B, H, Hkv, Nq, Nk, D, causal, seqlens = geometry
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens)
    counts = debug.tile_counts(backend, q, k, v, causal=causal, seqlens_k=sl, kernel=kernel)
    visited, skipped = _expected_q_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, counts.block_m, counts.block_n)
    assert torch.equal(counts.visited, visited), f"visited {counts.visited.tolist()} != {visited.tolist()}"
    assert torch.equal(counts.skipped, skipped)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_kv_stationary_tile_counts_match_geometry(geometry):
    B, H, Hkv, Nq, Nk, D, causal, seqlens = geometry
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens)
    counts = debug.tile_counts("triton_2kernel", q, k, v, causal=causal, seqlens_k=sl, kernel="dkdv")
    visited, skipped = _expected_kv_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, counts.block_m, counts.block_n)
    assert torch.equal(counts.visited, visited), f"visited {counts.visited.tolist()} != {visited.tolist()}"
    assert torch.equal(counts.skipped, skipped)


def test_tile_counts_with_unequal_blocks():
    """BLOCK_M != BLOCK_N: the diagonal spans several K/V tiles; the early exit must still be exact."""
    B, H, Hkv, Nq, Nk, D, causal, seqlens = 1, 1, 1, 70, 90, 16, True, [77]
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens)
    for bm, bn in ((32, 16), (16, 32)):
        fwd = debug.tile_counts("triton_2kernel", q, k, v, causal=causal, seqlens_k=sl, block_m=bm, block_n=bn)
        assert torch.equal(fwd.visited, _expected_q_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn)[0])
        kv = debug.tile_counts("triton_2kernel", q, k, v, causal, sl, kernel="dkdv", block_m=bm, block_n=bn)
        assert torch.equal(kv.visited, _expected_kv_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn)[0])


# (B, H, Hkv, Nq, Nk, causal, seqlens_k, window): sliding windows with causal, both sides bounded, one side only,
# negative sides (a band off the diagonal), an empty band (no row sees a key), windows narrower than a tile and wider
# than the sequence, Nq != Nk both ways, seqlens_k cutting inside the window.
WINDOWS = [
    (1, 2, 1, 70, 70, True, None, (20, 0)),
    (2, 1, 1, 64, 90, True, [90, 33], (5, None)),
    (1, 1, 1, 81, 47, False, None, (9, 12)),
    (2, 2, 2, 40, 75, False, [60, 75], (None, -20)),
    (1, 1, 1, 50, 50, False, None, (-10, 30)),
    (1, 1, 1, 48, 48, True, None, (-3, None)),
    (1, 2, 1, 33, 66, True, [50], (1000, -7)),
    (1, 1, 1, 66, 33, False, [20], (3, 3)),
]


@pytest.mark.parametrize("geometry", WINDOWS)
@pytest.mark.parametrize(
    "backend,kernel", [("triton_2kernel", "forward"), ("triton_2kernel", "dq"), ("triton_atomic", "atomic")]
)
def test_q_stationary_kernels_skip_exactly_the_tiles_outside_the_window(geometry, backend, kernel):
    """A K/V tile that no real row sees through the window is never loaded, every other one is: the kernels' own
    counters against the tiles of SPEC.md's mask."""
    B, H, Hkv, Nq, Nk, causal, seqlens, window = geometry
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, 16, seqlens)
    for bm, bn in ((16, 16), (32, 16), (16, 32)):
        counts = debug.tile_counts(backend, q, k, v, causal, sl, kernel=kernel, window=window, block_m=bm, block_n=bn)
        visited, skipped = _expected_q_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn, window)
        assert torch.equal(counts.visited, visited), f"{bm}x{bn}: {counts.visited.tolist()} != {visited.tolist()}"
        assert torch.equal(counts.skipped, skipped)


@pytest.mark.parametrize("geometry", WINDOWS)
def test_kv_stationary_kernel_skips_exactly_the_q_tiles_outside_the_window(geometry):
    B, H, Hkv, Nq, Nk, causal, seqlens, window = geometry
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, 16, seqlens)
    for bm, bn in ((16, 16), (32, 16), (16, 32)):
        counts = debug.tile_counts(
            "triton_2kernel", q, k, v, causal, sl, kernel="dkdv", window=window, block_m=bm, block_n=bn
        )
        visited, skipped = _expected_kv_stationary(B, H, Hkv, Nq, Nk, causal, seqlens, bm, bn, window)
        assert torch.equal(counts.visited, visited), f"{bm}x{bn}: {counts.visited.tolist()} != {visited.tolist()}"
        assert torch.equal(counts.skipped, skipped)


def _slopes(B, H, per_batch, seed):
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand((B, H) if per_batch else (H,), generator=g) * 0.5
    return slopes.to(DEVICE)


# (B, H, Hkv, Nq, Nk, D, Dv, causal, seqlens_k, window, softcap, ALiBi slopes per batch?) (None: no ALiBi)
MODIFIED = [
    (2, 2, 1, 37, 53, 40, 24, True, [46, 0], (11, 0), 2.0, True),
    (1, 2, 2, 45, 30, 16, 32, False, None, (6, 6), 0.0, False),
    (2, 2, 1, 30, 30, 24, 24, True, [30, 9], None, 1.5, None),
    (1, 4, 2, 20, 41, 16, 16, False, [33], (None, -5), 0.0, None),
    (1, 1, 1, 33, 33, 16, 48, True, None, (-2, None), 3.0, True),  # empty band: o = 0, lse = -inf, no gradient
]


@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("case", MODIFIED)
def test_score_modifiers_match_the_oracle(name, case):
    """Windows, soft cap, ALiBi ([H] and [B, H]) and Dv != D, alone and together, with seqlens_k, GQA, Nq != Nk and
    head dims below their tiles: all five outputs against the float64 oracle."""
    B, H, Hkv, Nq, Nk, D, Dv, causal, seqlens, window, softcap, per_batch = case
    q, k, _, _, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens, seed=21)
    _, _, v, do, _ = _inputs(B, H, Hkv, Nq, Nk, Dv, seqlens, seed=22)
    alibi = None if per_batch is None else _slopes(B, H, per_batch, seed=23)
    o, lse, dq, dk, dv = _check_all(
        attnzoo.get(name), q, k, v, do, causal, sl, window=window, softcap=softcap, alibi_slopes=alibi
    )
    assert o.shape == (B, H, Nq, Dv) and dv.shape == v.shape
    if window == (-2, None):
        assert not o.any() and torch.isneginf(lse).all() and not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("name", TRITON)
def test_softcap_and_alibi_in_fp16_match_the_oracle_rule(name):
    q, k, v, do, sl = _inputs(2, 2, 1, 40, 56, 64, [56, 30], dtype=torch.float16, seed=24)
    alibi = _slopes(2, 2, True, seed=25)
    _check_all(attnzoo.get(name), q, k, v, do, True, sl, scale=0.5, window=(17, 0), softcap=4.0, alibi_slopes=alibi)


def test_a_window_through_tensor_descriptors_equals_pointer_loads():
    """The unmasked middle stage of a windowed call loads K/V through descriptors (the edge stages through pointers):
    the same bits as pointer loads everywhere, forward and backward, with Dv != D."""
    q, k, _, _, sl = _inputs(2, 2, 1, 70, 90, 32, [90, 41], seed=26)
    _, _, v, do, _ = _inputs(2, 2, 1, 70, 90, 16, [90, 41], seed=27)
    pointer_cfg = KernelConfig(16, 16, 1, 1)
    kw = dict(causal=True, seqlens_k=sl, window=(40, 0), softcap=3.0)
    results = {}
    for tma in (False, True):
        cfg = dataclasses.replace(pointer_cfg, tma=tma)
        backend = attnzoo.get("triton_2kernel", configs={"forward": cfg, "dq": cfg, "dkdv": pointer_cfg})
        o, lse = backend.forward(q, k, v, **kw)
        results[tma] = (o, lse, *backend.backward(do, q, k, v, o, lse, **kw))
    for with_descriptors, with_pointers in zip(results[True], results[False], strict=True):
        assert torch.equal(with_descriptors, with_pointers)


# Every variant with a Gluon kernel (the five-product backward's two share the dK/dV kernel's).
GLUON_VARIANTS = [
    KernelVariant.FORWARD,
    KernelVariant.DKDV,
    KernelVariant.ATOMIC_PREPROCESS,
    KernelVariant.ATOMIC_ORDERED,
]


@pytest.mark.parametrize(
    "modifier,field,reason",
    [
        (dict(window=(8, 0)), "window", "window"),
        (dict(window=(None, -3)), "window", "window"),
        (dict(softcap=5.0), "softcap", "softcap"),
        (dict(alibi_slopes=torch.full((2,), 0.5)), "alibi", "alibi"),
    ],
)
@pytest.mark.parametrize("variant", GLUON_VARIANTS)
def test_the_gluon_scopes_name_the_modifiers_their_kernels_lack(variant, modifier, field, reason):
    """A call with a modifier a Gluon kernel does not apply runs the Triton kernel with the same tiles (the tuner then
    drops the ``gluon`` twin): its scope names the modifier; one the kernel applies is not named."""
    q, k, v, _, _ = _inputs(1, 2, 2, 64, 64, 64, None, dtype=torch.float16)
    modifier = {key: val.to(DEVICE) if isinstance(val, torch.Tensor) else val for key, val in modifier.items()}
    call = prepare(q, k, v, validate_forward(q, k, v, **modifier))
    scope = variant.gluon_scope
    reasons = scope.modifier_reasons(call.modifiers)
    applies = field is not None and getattr(scope, field)
    assert applies != any(reason in r for r in reasons), reasons
    assert scope.modifier_reasons(prepare(q, k, k, validate_forward(q, k, k)).modifiers) == []


@pytest.mark.parametrize(
    "variant", [KernelVariant.FORWARD, KernelVariant.DKDV, KernelVariant.DQ, KernelVariant.ATOMIC_PREPROCESS]
)
def test_the_gluon_scopes_take_the_head_dims_their_kernels_were_checked_with(variant):
    """D = Dv = 64 and 128 run every Gluon kernel; D = 192 with Dv = 128 (in two column parts) and D = Dv = 256 the
    forward's and the two-kernel backward's (backward_gluon_wide.py above D = 128), not the five-product one; other
    pairs do not, and the reason names them.  The forward and the two-kernel backward take packed batches at each of
    their pairs (no pair is limited to dense calls); the five-product kernel takes none."""
    scope = variant.gluon_scope
    wide = {
        KernelVariant.FORWARD: [(192, 128), (256, 256)],
        KernelVariant.DKDV: [(192, 128), (256, 256)],
        KernelVariant.DQ: [(192, 128), (256, 256)],
    }
    in_scope = [(64, 64), (128, 128), *wide.get(variant, [])]
    for dims in in_scope:
        assert scope.head_dim_reasons(*dims) == [], dims
    for dims in {(64, 32), (256, 256), (192, 192), (192, 128)} - set(in_scope):
        assert any(f"D={dims[0]} Dv={dims[1]}" in r for r in scope.head_dim_reasons(*dims))
    assert scope.varlen == (variant in wide)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@needs_descriptors
def test_forward_through_tensor_descriptors_equals_pointer_loads(geometry):
    """A ``tma`` config loads the unmasked K/V tiles through 4-d tensor descriptors: the same tiles as the pointer
    path, so the same bits out, across the masking geometries (tails, causal offsets, seqlens_k, GQA, D < BLOCK_D)."""
    B, H, Hkv, Nq, Nk, D, causal, seqlens = geometry
    q, k, v, _, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens)
    problem = validate_forward(q, k, v, causal, None, sl)
    pointer_cfg = KernelConfig(16, 16, 1, 1)
    descriptor_call = prepare(q, k, v, problem, forced={"forward": dataclasses.replace(pointer_cfg, tma=True)})
    assert descriptor_call.kv_descriptors
    o, lse = attention_forward(descriptor_call)
    o_ptr, lse_ptr = attention_forward(prepare(q, k, v, problem, forced={"forward": pointer_cfg}))
    assert torch.equal(o, o_ptr) and torch.equal(lse, lse_ptr)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@needs_descriptors
def test_dq_kernel_through_tensor_descriptors_equals_pointer_loads(geometry):
    """A ``tma`` config of the dQ kernel loads the K/V tiles of its unmasked stage through descriptors: the same
    bits out as the pointer loads across the masking geometries."""
    B, H, Hkv, Nq, Nk, D, causal, seqlens = geometry
    q, k, v, do, sl = _inputs(B, H, Hkv, Nq, Nk, D, seqlens)
    assert descriptor_loads_possible(k) and descriptor_loads_possible(v)
    pointer_cfg = KernelConfig(16, 16, 1, 1)
    grads = {}
    for tma in (False, True):
        forced = {"forward": pointer_cfg, "dq": dataclasses.replace(pointer_cfg, tma=tma), "dkdv": pointer_cfg}
        backend = attnzoo.get("triton_2kernel", configs=forced)
        o, lse = backend.forward(q, k, v, causal=causal, seqlens_k=sl)
        grads[tma] = backend.backward(do, q, k, v, o, lse, causal=causal, seqlens_k=sl)
    for with_descriptors, with_pointers in zip(grads[True], grads[False], strict=True):
        assert torch.equal(with_descriptors, with_pointers)


@needs_descriptors
def test_descriptor_loads_need_aligned_rows_and_a_unit_last_stride():
    """TMA needs a 16-byte aligned base, positive 16-byte aligned outer strides and a contiguous last dimension;
    other inputs keep pointer loads (a ``tma`` config then runs its pointer twin) and are still right."""
    x = torch.randn(1, 2, 8, 17)
    assert descriptor_loads_possible(torch.randn(1, 2, 8, 16))
    assert not descriptor_loads_possible(x[..., :16])  # row stride 17 * 4 bytes
    assert not descriptor_loads_possible(torch.randn(1, 2, 8, 33)[..., 1:17])  # base 4 bytes past alignment
    assert not descriptor_loads_possible(torch.randn(1, 2, 16, 8).transpose(-1, -2))  # last stride 8
    assert not descriptor_loads_possible(torch.randn(1, 1, 8, 16).expand(1, 4, 8, 16))  # head stride 0
    assert not descriptor_loads_possible(torch.randn(1, 2, 0, 16))  # Nk = 0: a descriptor needs positive sizes
    q, k, v, _, _ = _inputs(1, 2, 2, 8, 8, 16, None)
    k = x[..., :16]
    forced = {"forward": KernelConfig(16, 16, 1, 1, tma=True)}
    call = prepare(q, k, v, validate_forward(q, k, v), forced=forced)
    assert not call.kv_descriptors
    o, _ = attention_forward(call)
    torch.testing.assert_close(o.double(), oracle.reference(q, k, v).o, atol=1e-5, rtol=1e-5)


@needs_descriptors
def test_a_prepared_call_is_reused_only_for_the_same_signature():
    """``prepare`` remembers a dense call's fields by its signature (the problem, the strides, the base addresses
    modulo 16): other tensors of that signature get the same decisions, a base off alignment gets its own, and the
    remembered template holds no tensor."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    problem = validate_forward(q, k, v)
    first = prepare(q, k, v, problem)
    q2, k2, v2 = (torch.randn(1, 2, 8, 16) for _ in range(3))
    again = prepare(q2, k2, v2, problem)
    assert again.q is q2 and again.k is k2 and again.v is v2
    assert again.derived is first.derived and again.kv_descriptors
    # Launches of one template reuse its kernels (compiled_launch); another operand's strides or alignment do not.
    assert again.template_id == first.template_id is not None
    assert again.launch_key(q2) == first.launch_key(q) != first.launch_key(q.transpose(1, 2))
    assert first.launch_key(torch.randn(1 * 2 * 8 * 16 + 1)[1:].view(1, 2, 8, 16)) != first.launch_key(q)
    shifted = torch.randn(2 * 8 * 16 + 1)[1:].view(1, 2, 8, 16)  # the same strides, the base 4 bytes past alignment
    off = prepare(q2, shifted, v2, problem)
    assert off.k is shifted and off.derived is not first.derived and not off.kv_descriptors
    assert off.template_id != first.template_id
    assert prepare(q, k, v, problem).kv_descriptors
    transposed = torch.randn(1, 8, 2, 16).transpose(1, 2)  # other strides
    assert prepare(q, transposed, v, problem).derived is not first.derived
    forced = {"forward": KernelConfig(16, 16, 1, 1)}
    pinned = prepare(q, k, v, problem, forced=forced)
    assert pinned.derived is not first.derived and pinned.forced == forced
    narrow_q, narrow_k = torch.randn(1, 2, 8, 40), torch.randn(1, 2, 8, 40)
    for v_rows, block_dv in ((torch.randn(1, 2, 8, 32), 32), (torch.randn(1, 2, 8, 40)[..., :32], 64)):
        narrow = validate_forward(narrow_q, narrow_k, v_rows)  # v's row stride decides its tile (value_tile_width)
        assert prepare(narrow_q, narrow_k, v_rows, narrow).block_dv == block_dv
    assert all(t.q is None and t.k is None and t.v is None for t in launch_module._TEMPLATES.values())


def test_a_gluon_config_outside_the_hopper_scope_runs_its_triton_twin():
    """A ``gluon`` config runs a Gluon Hopper kernel only where it can (``KernelVariant.gluon_scope``); here (the
    interpreter, or float32 on a GPU) the forward, the dQ and the dK/dV kernel run their Triton kernels with the same
    tiles: the same bits."""
    q, k, v, do, sl = _inputs(2, 2, 1, 37, 53, 40, [46, 0])
    triton_cfg = KernelConfig(16, 16, 1, 1)
    gluon_cfg = dataclasses.replace(triton_cfg, gluon=True)
    gluon_call = prepare(
        q, k, v, validate_forward(q, k, v, True, None, sl), forced=dict.fromkeys(("forward", "dq", "dkdv"), gluon_cfg)
    )
    for variant, extra in ((KernelVariant.FORWARD, ()), (KernelVariant.DKDV, (do,)), (KernelVariant.DQ, (do, do))):
        reasons = gluon_call.gluon_reasons(variant, *extra)
        assert any("seqlens_k" in r or "interpreter" in r or "Gluon" in r for r in reasons), reasons
    assert gluon_call.gluon_reasons(KernelVariant.ATOMIC_RECOMPUTE) == ["atomic:recompute has no Gluon kernel"]
    gluon = attnzoo.get("triton_2kernel", configs=dict.fromkeys(("forward", "dq", "dkdv"), gluon_cfg))
    twin = attnzoo.get("triton_2kernel", configs=dict.fromkeys(("forward", "dq", "dkdv"), triton_cfg))
    o, lse = gluon.forward(q, k, v, causal=True, seqlens_k=sl)
    o_twin, lse_twin = twin.forward(q, k, v, causal=True, seqlens_k=sl)
    assert torch.equal(o, o_twin) and torch.equal(lse, lse_twin)
    grads = gluon.backward(do, q, k, v, o, lse, causal=True, seqlens_k=sl)
    grads_twin = twin.backward(do, q, k, v, o, lse, causal=True, seqlens_k=sl)
    for got, twin in zip(grads, grads_twin, strict=True):
        assert torch.equal(got, twin)


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_gluon_candidates_are_tuned_only_where_the_gluon_kernel_runs(monkeypatch, kernel):
    """Outside a Gluon kernel's scope a ``gluon`` candidate would launch the Triton kernel with the same tiles: the
    tuner drops it instead of timing one kernel twice; inside the scope it is a candidate like any other."""
    q, k, v, _, _ = _inputs(1, 2, 2, 64, 64, 64, None, dtype=torch.float16)
    problem = validate_forward(q, k, v)
    seen = []

    def fake_choose(key, configs, launch, reset):
        seen.append(list(configs))
        return configs[0]

    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    monkeypatch.setattr(tuning.AUTOTUNER, "choose", fake_choose)
    monkeypatch.setattr(tuning, "_launched", lambda cfg, launch, reset: True)
    monkeypatch.setattr(launch_module, "triton_interpreter_active", lambda: False)
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 232_448)  # an H100's
    monkeypatch.setattr(tuning, "_device_identity", lambda index: None)
    for in_scope in (False, True):
        tuning.AUTOTUNER.best.clear()
        with tuning.autotuning():
            launch_module.run(
                prepare(q, k, v, problem), KernelVariant(kernel), lambda cfg: None, gluon_in_scope=in_scope
            )
    assert seen[0] and not any(c.gluon for c in seen[0])
    assert any(c.gluon for c in seen[1]) and any(not c.gluon for c in seen[1])


def test_tile_counts_rejects_unknown_kernel():
    q, k, v, _, _ = _inputs(1, 1, 1, 16, 16, 16, None)
    with pytest.raises(ValueError, match="kernel"):
        debug.tile_counts("triton_2kernel", q, k, v, kernel="atomic")
    with pytest.raises(ValueError, match="tile counts"):
        debug.tile_counts("numpy_ref", q, k, v)


@pytest.mark.parametrize("delta", ["recompute", "preprocess"])
def test_atomic_delta_variants_match_oracle(delta):
    q, k, v, do, sl = _inputs(2, 4, 2, 45, 38, 24, [38, 11], seed=3)
    _check_all(attnzoo.get("triton_atomic", delta=delta), q, k, v, do, True, sl)


def test_atomic_delta_option():
    assert attnzoo.get("triton_atomic").delta == "preprocess"
    assert TritonAtomic(delta="recompute").delta == "recompute"
    assert attnzoo.get("triton_atomic", delta="recompute").delta == "recompute"
    assert not attnzoo.get("triton_atomic").capabilities.deterministic
    assert attnzoo.get("triton_2kernel").capabilities.deterministic
    with pytest.raises(ValueError, match="delta"):
        TritonAtomic(delta="twice")


def test_atomic_deterministic_option():
    """``deterministic=True`` declares a reproducible backward; off Hopper's Gluon kernel (here: the interpreter) it
    is the two-kernel backward, bit for bit."""
    ordered = attnzoo.get("triton_atomic", deterministic=True)
    assert ordered.capabilities.deterministic and not attnzoo.get("triton_atomic").capabilities.deterministic
    with pytest.raises(ValueError, match="deterministic"):
        TritonAtomic(delta="recompute", deterministic=True)
    with pytest.raises(TypeError, match="deterministic"):
        TritonAtomic(deterministic="yes")
    with pytest.raises(ValueError, match="deterministic=True with configs"):  # the Triton kernel has no fixed order
        TritonAtomic(deterministic=True, configs={"atomic": "128x64 w8 s2"})
    q, k, v, do, _ = _inputs(1, 2, 1, 40, 40, 16, None, seed=4)
    o, lse = ordered.forward(q, k, v, causal=True)
    grads = ordered.backward(do, q, k, v, o, lse, causal=True)
    two_kernel = attnzoo.get("triton_2kernel").backward(do, q, k, v, o, lse, causal=True)
    for a, b in zip(grads, two_kernel, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", TRITON)
def test_fp16_matches_oracle_rule(name):
    q, k, v, do, sl = _inputs(2, 2, 1, 40, 56, 64, [56, 30], dtype=torch.float16, seed=5)
    _check_all(attnzoo.get(name), q, k, v, do, True, sl)


@pytest.mark.parametrize("name", TRITON)
def test_garbage_past_seqlens_never_leaks(name):
    """Keys past seqlens_k are never read into P @ V: NaN there must not reach any output."""
    q, k, v, do, sl = _inputs(2, 2, 2, 24, 40, 16, [17, 0], seed=7)
    clean = _check_all(attnzoo.get(name), q, k, v, do, False, sl)
    k_bad, v_bad = k.clone(), v.clone()
    for b, n in enumerate(sl.tolist()):
        k_bad[b, :, n:] = float("nan")
        v_bad[b, :, n:] = float("inf")
    be = attnzoo.get(name)
    o, lse = be.forward(q, k_bad, v_bad, seqlens_k=sl)
    dq, dk, dv = be.backward(do, q, k_bad, v_bad, o, lse, seqlens_k=sl)
    for got, want in zip((o, lse, dq), clean[:3], strict=True):
        assert torch.equal(got, want)
    for got, want in zip((dk, dv), clean[3:], strict=True):
        assert not torch.isnan(got).any()
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("name", TRITON)
def test_fully_masked_rows(name):
    """seqlens_k = 0 for one batch and causal Nq > Nk: o = 0, lse = -inf, zero gradients, no NaN."""
    q, k, v, do, sl = _inputs(2, 2, 1, 30, 12, 16, [0, 12], seed=9)
    o, lse, dq, dk, dv = _check_all(attnzoo.get(name), q, k, v, do, True, sl)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert not dq[0].any() and not dk[0].any() and not dv[0].any()
    assert torch.isneginf(lse[1, :, :18]).all() and not o[1, :, :18].any()


@pytest.mark.parametrize("name", TRITON)
def test_any_strides(name):
    """[B, N, H, D] storage transposed to [B, H, N, D], and K/V broadcast over heads with stride 0."""
    g = torch.Generator().manual_seed(11)
    B, H, Nq, Nk, D = 2, 4, 29, 35, 24
    q = torch.randn(B, Nq, H, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Nk, 1, D, generator=g).transpose(1, 2).expand(B, 2, Nk, D)
    v = torch.randn(B, 1, Nk, D + 8, generator=g)[..., :D].expand(B, 2, Nk, D)
    do = torch.randn(B, H, Nq, D, generator=g)
    if DEVICE == "cuda":
        q, k, v, do = (x.to(DEVICE) for x in (q, k, v, do))
    _check_all(attnzoo.get(name), q, k, v, do, True, None, scale=0.3)


def test_support_declarations(monkeypatch):
    be = attnzoo.get("triton_2kernel")
    q = torch.randn(1, 1, 16, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_base.INTERPRETER_REASON in be.not_supported_reasons(q, q, q)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert be.not_supported_reasons(q, q, q) == []
    reasons = be.not_supported_reasons(q.bfloat16(), q.bfloat16(), q.bfloat16())
    assert len(reasons) == 1 and "raw uint16 bits" in reasons[0]
    for name in TRITON:
        caps = attnzoo.get(name).capabilities
        assert caps.max_head_dim == 256 and "cpu" not in caps.auto_rank
    assert attnzoo.get("triton_2kernel").capabilities.auto_rank == {"cuda": 0}
    assert attnzoo.get("triton_atomic").capabilities.auto_rank == {"cuda": 1}


def test_autotuner_resets_accumulators_before_every_launch(monkeypatch):
    """Tuning trials of an accumulating kernel must not leave partial sums in its output."""
    launches = []
    out = torch.zeros(4)

    def launch(cfg: KernelConfig) -> None:  # a stand-in kernel that accumulates like atomic_add
        launches.append(cfg)
        out.add_(cfg.block_m)

    def fake_bench(fn, **kwargs):
        for _ in range(3):
            fn()
        return float(launches[-1].block_m == 64)  # the 32-row config is "fastest"

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    monkeypatch.setattr(tuning, "_device_identity", lambda index: None)
    monkeypatch.setattr(launch_module, "triton_interpreter_active", lambda: False)
    configs = [KernelConfig(64, 64, 4, 2), KernelConfig(32, 64, 4, 2)]
    monkeypatch.setattr(tuning, "candidates", lambda *a: configs)
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "1")
    x = torch.randn(1, 1, 16, 16)
    call = prepare(x, x, x, validate_forward(x, x, x, scale=1.0))
    chosen = launch_module.run(call, KernelVariant.ATOMIC_PREPROCESS, launch, reset=out.zero_)
    assert chosen == configs[1] and len(launches) > 2
    assert torch.equal(out, torch.full((4,), 32.0)), "buffers kept sums from tuning trials"
    # Cached afterwards: one launch, again from zero.
    launch_module.run(call, KernelVariant.ATOMIC_PREPROCESS, launch, reset=out.zero_)
    assert torch.equal(out, torch.full((4,), 32.0))


def test_autotuner_describes_its_choice_fastest_first(monkeypatch):
    """The line `attnzoo bench` logs per tuned key: every candidate, as its time over the fastest's."""
    times = {KernelConfig(64, 64, 4, 2): 2.0, KernelConfig(32, 64, 4, 2): 1.0, KernelConfig(16, 16, 1, 1): 1.5}
    configs = list(times)
    calls = []

    def fake_bench(fn, **kwargs):
        fn()
        return times[calls[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    tuner = Autotuner()
    key = ("dkdv", 128, torch.float16, True, False, 4096, 4096, "ieee", 0)
    assert tuner.choose(key, configs, calls.append, None) == KernelConfig(32, 64, 4, 2)
    assert tuner.describe(key) == (
        "dkdv BLOCK_D=128 float16 causal=True seqlens=False Nq<=4096 Nk<=4096 dot=ieee: "
        "32x64 w4 s2 1.00 [1.00 1.00], 16x16 w1 s1 1.50 [1.50 1.50], 64x64 w4 s2 2.00 [2.00]"
    )


def _fake_bench_from(times: dict[KernelConfig, list[float]], launched: list, timed: list):
    """A stand-in for ``triton.testing.do_bench``: the i-th timing of a config returns ``times[config][i]``."""

    def fake_bench(fn, **kwargs):
        fn()
        cfg = launched[-1]
        timed.append(cfg)
        return times[cfg][timed.count(cfg) - 1]

    return fake_bench


def test_autotuner_screens_twice_then_retimes_close_candidates_in_alternating_rounds(monkeypatch):
    """Every candidate within 50% of the fastest first timing is timed a second time, in reverse order, and counts
    with its faster timing; those within 10% of the fastest are then timed again, in turns, and the median of their
    rounds decides.  A clearly slower candidate is timed once."""
    a, b, slow, slower = (KernelConfig(64, 64, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(16, 16, 1, 1),
                          KernelConfig(16, 32, 1, 1))  # fmt: skip
    times = {
        a: [1.00, 1.02, 1.10, 1.12, 0.90],  # screens, then three rounds with one fast outlier
        b: [1.08, 1.09, 1.00, 1.01, 1.02],
        slow: [1.2, 1.3],
        slower: [1.6],
    }
    launched, timed = [], []
    monkeypatch.setattr(triton.testing, "do_bench", _fake_bench_from(times, launched, timed))
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "1")
    tuner = Autotuner()
    key = ("forward", 64, torch.float16, False, False, 1024, 1024, "ieee", 0)
    assert tuner.choose(key, [a, b, slow, slower], launched.append, None) == b
    assert timed == [a, b, slow, slower, slow, b, a, a, b, a, b, a, b]
    assert tuner.timings[key] == {a: 1.10, b: 1.01, slow: 1.2, slower: 1.6}
    assert tuner.screens[key] == {a: [1.00, 1.02], b: [1.08, 1.09], slow: [1.2, 1.3], slower: [1.6]}


def test_autotuner_recovers_a_candidate_whose_first_timing_was_slow(monkeypatch):
    """One slow timing (the GPU in a slow phase) must not drop the fastest candidate: its second screening timing
    brings it into the re-timing, which it wins."""
    best, other = KernelConfig(128, 64, 8, 3, tma=True), KernelConfig(128, 64, 8, 3)
    times = {other: [1.00, 1.01, 1.06, 1.07, 1.06], best: [1.20, 0.99, 1.00, 0.98, 1.01]}
    launched, timed = [], []
    monkeypatch.setattr(triton.testing, "do_bench", _fake_bench_from(times, launched, timed))
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "1")
    tuner = Autotuner()
    key = ("dq", 128, torch.float16, False, False, 16384, 16384, "ieee", 0)
    assert tuner.choose(key, [other, best], launched.append, None) == best
    assert tuner.timings[key] == {other: 1.06, best: 1.00}


def test_autotuner_compiles_every_candidate_before_timing_and_warms_up_the_first(monkeypatch):
    """Compilation is host time with the GPU idle: no timing may follow it directly, and the first timing starts
    after WARMUP_MS of untimed runs (the GPU's clocks settle)."""
    configs = [KernelConfig(64, 64, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(16, 16, 1, 1)]
    events = []

    def fake_bench(fn, warmup, **kwargs):
        events.append(("timed", warmup))
        fn()
        return 1.0 + len(events)  # the earliest timed is fastest, no one within 10%

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "1")
    tuner = Autotuner()
    key = ("forward", 64, torch.float16, False, False, 1024, 1024, "ieee", 0)
    assert tuner.choose(key, configs, lambda cfg: events.append(("launch", cfg)), None) == configs[0]
    assert events[:3] == [("launch", cfg) for cfg in configs]
    warmups = [e[1] for e in events if e[0] == "timed"]
    assert warmups[:3] == [tuning.WARMUP_MS, 10.0, 10.0] and set(warmups[3:]) == {10.0}


def test_candidates_pruned_by_shared_memory(monkeypatch):
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 100_000)
    fitting = tuning.candidates("forward", 128, torch.float16, torch.device("cpu"))
    assert fitting and all(tuning.shared_memory_estimate("forward", c, 128, 2) <= 100_000 for c in fitting)
    assert len(fitting) < len(tuning.CANDIDATES["forward"])
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 1)
    assert len(tuning.candidates("dkdv", 256, torch.float32, torch.device("cpu"))) == 1


def test_gluon_configs_fit_by_the_exact_head_dims_where_the_gluon_kernel_runs(monkeypatch):
    """D = 192, Dv = 128: the Triton kernels' tile is 256 wide, the Gluon forward's tiles 128 + 64 (K) and 128 (V),
    so its 128 x 128 two-stage tile fits an H100's shared memory (213 KB) and the three-stage one does not."""
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 232_448)  # an H100's
    two_stages, three_stages = KernelConfig.parse("128x128 w8 s2 gluon"), KernelConfig.parse("128x128 w8 s3 gluon")
    as_triton = tuning.candidates("forward", 256, torch.float16, torch.device("cpu"))
    as_gluon = tuning.candidates("forward", 256, torch.float16, torch.device("cpu"), gluon_head_dims=(192, 128))
    assert two_stages not in as_triton and two_stages in as_gluon and three_stages not in as_gluon
    assert [c for c in as_gluon if not c.gluon] == [c for c in as_triton if not c.gluon]
    assert tuning.shared_memory_estimate("forward", two_stages, 192, 2, 128) == 2 * (192 * (128 + 256) + 128 * 256)
    # D = 128, Dv = 64: O leaves through rows of its own (128 x 64), which the estimate counts.
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 2 * (128 * 384 + 64 * 256) + 2 * 128 * 64 - 1)
    assert two_stages not in tuning.candidates("forward", 128, torch.float16, torch.device("cpu"), (128, 64))


def test_a_persistent_block_holds_two_sets_of_q_rows_where_the_shared_memory_has_room():
    """The persistent 128-row forward loads the next block's Q rows while it runs this one where a second set fits
    beside the K/V rings (an H100's 232,448 bytes): D = 64 and 128 at two stages; not D = 128 at three stages (229 KB
    with one set), D = 192 with Dv = 128 (213 KB) or D = 256 (197 KB at 64-key tiles)."""
    from attnzoo.kernels.forward_gluon import persistent_q_sets

    h100 = 232_448
    assert persistent_q_sets(128, 128, 128, 2, 2, h100) == 2
    assert persistent_q_sets(64, 64, 128, 2, 2, h100) == 2
    assert persistent_q_sets(128, 128, 128, 3, 2, h100) == 1
    assert persistent_q_sets(192, 128, 128, 2, 2, h100) == 1
    assert persistent_q_sets(256, 256, 64, 2, 2, h100) == 1
    # The bytes counted: two sets of Q rows (128 x 128), two K and two V tiles of 128 keys, the mbarriers.
    assert persistent_q_sets(128, 128, 128, 2, 2, 2 * (2 * 128 * 128 + 2 * 128 * 256) + 1024) == 2
    assert persistent_q_sets(128, 128, 128, 2, 2, 2 * (2 * 128 * 128 + 2 * 128 * 256) + 1023) == 1


def test_wide_tiles_take_the_configs_timed_at_d192(monkeypatch):
    """Head-dim tile 256 (D = 192, 256): the untimed pick is the wide list's (timed at D = 192, Dv = 128; where
    Dv = 256 leaves those out of the shared memory, ptxas's ranking), and V's own tile (Dv = 128 at D = 192) is what
    the shared-memory estimate counts, so the 128 x 64 three-stage forward fits."""
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 232_448)  # an H100's
    cpu, pick = torch.device("cpu"), tuning.heuristic_pick

    def triton_tiles(kernel, dv):  # outside the Gluon scope (D = 192; D = 256 off Hopper): the launcher's filter
        return [c for c in tuning.candidates(kernel, 256, torch.float16, cpu, block_dv=dv) if not c.gluon]

    for dv, dkdv, dq in ((128, "32x128 w8 s3", "64x64 w4 s3 tma"), (256, "64x32 w8 s2", "64x32 w4 s2")):
        assert str(pick("dkdv", 256, triton_tiles("dkdv", dv))) == dkdv
        assert str(pick("dq", 256, triton_tiles("dq", dv))) == dq
    # D = Dv = 256 and D = 192 with Dv = 128 in the Gluon scope: the head-dim-split kernels (backward_gluon_wide.py),
    # whose one tile is the only Gluon candidate (at D = 192 others fit the shared memory but have no kernel).
    for kernel, dims in itertools.product(("dkdv", "dq"), ((256, 256), (192, 128))):
        in_scope = tuning.candidates(kernel, 256, torch.float16, cpu, gluon_head_dims=dims)
        assert [str(c) for c in in_scope if c.gluon] == ["64x64 w4 s2 gluon"], (kernel, dims)
        assert str(pick(kernel, 256, in_scope)) == "64x64 w4 s2 gluon"
    # Without TMA descriptors (the launcher drops TMA configs), the dQ pick is the next of the list.
    no_tma = [c for c in triton_tiles("dq", 128) if not c.tma]
    assert str(pick("dq", 256, no_tma)) == "128x32 w8 s3"
    assert str(pick("atomic", 256, tuning.candidates("atomic", 256, torch.float16, cpu))) == "128x32 w8 s2"
    # The Gluon forward: its 128 x 128 tile where that fits (D = 192, Dv = 128), else its 128 x 64 one (D = 256).
    for dims, forward in (((192, 128), "128x128 w8 s2 gluon"), ((256, 256), "128x64 w8 s2 gluon")):
        fitting = tuning.candidates("forward", 256, torch.float16, cpu, gluon_head_dims=dims)
        assert str(pick("forward", 256, fitting)) == forward
    wide_v, narrow_v = (tuning.candidates("forward", 256, torch.float16, cpu, block_dv=dv) for dv in (256, 128))
    assert str(pick("forward", 256, [c for c in wide_v if not c.gluon])) == "64x32 w4 s2"
    assert str(pick("forward", 256, [c for c in narrow_v if not c.gluon])) == "128x64 w8 s3 tma"
    # Tiles of 64 and 128 keep their measured lists.
    assert str(pick("dkdv", 128, tuning.candidates("dkdv", 128, torch.float16, cpu))) == "64x64 w4 s2 gluon"


def test_a_head_dim_reaches_the_gluon_tiles_in_at_most_two_power_of_two_parts():
    from attnzoo.kernels.gluon_hopper import head_dim_parts

    assert [head_dim_parts(d) for d in (64, 128, 256, 192, 96, 80)] == [
        (64, 0), (128, 0), (256, 0), (128, 64), (64, 32), (64, 16),
    ]  # fmt: skip
    for d in (72, 112, 200):  # a rest below one wgmma K step (16), or not a power of two
        with pytest.raises(ValueError, match=f"head dim {d}"):
            head_dim_parts(d)


@pytest.mark.parametrize("name", ["triton_2kernel", "triton_atomic"])
def test_views_with_a_huge_row_stride_are_addressed_correctly(name):
    """In-tile offsets are int32: a view whose row stride times the tile height passes 2^31 is copied to
    contiguous memory before the launch, and the result is right (the GPU test reads such rows for real)."""
    backend = attnzoo.get(name)
    stride = 150_000_000
    storage = torch.randn(stride + 16, dtype=torch.float16)
    q = storage.as_strided((1, 1, 2, 16), (0, 0, stride, 1))
    k, v, do = (torch.randn(1, 1, 3, 16, dtype=torch.float16) for _ in range(3))
    if backend.not_supported_reasons(q, k, v):
        pytest.skip("needs the interpreter or a GPU")
    o, lse = backend.forward(q, k, v)
    dq, dk, dv = backend.backward(do[:, :, :2], q, k, v, o, lse)
    ref = oracle.reference(q, k, v, do[:, :, :2])
    for got, want in ((o, ref.o), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=5e-3)


def test_only_views_that_could_wrap_int32_are_copied():
    rows_major = torch.randn(64, 3, 4, 16).permute(1, 2, 0, 3)  # [N, B, H, D] memory as [B, H, N, D]
    assert int32_addressable(rows_major) is rows_major
    storage = torch.empty(20_000_000 + 16, dtype=torch.float16)
    wide = storage.as_strided((1, 1, 2, 16), (0, 0, 20_000_000, 1))  # 128 rows x 20M > 2^31
    copied = int32_addressable(wide)
    assert copied is not wide and copied.is_contiguous() and torch.equal(copied, wide)


def test_a_narrow_value_tile_is_kept_only_for_aligned_rows_of_a_multiple_of_16():
    # (value_tile_width: with D not a power of two, a v tile narrower than q/k's read rows that are not 16-element
    # aligned wrong on the H100; such calls take q/k's tile width.)
    contiguous = torch.randn(1, 2, 8, 32)
    strided = torch.randn(1, 2, 8, 40)[..., :32]  # rows 40 apart
    assert value_tile_width(40, 32, 64, contiguous) == 32
    assert value_tile_width(40, 32, 64, strided) == 64
    assert value_tile_width(40, 8, 64, torch.randn(1, 2, 8, 8)) == 64  # rows 8 apart even when contiguous
    assert value_tile_width(64, 32, 64, strided) == 32  # q/k's columns unmasked: the narrow tile is kept
    assert value_tile_width(192, 128, 256, torch.randn(1, 2, 8, 128)) == 128
    assert value_tile_width(40, 40, 64, strided) == 64  # Dv's own tile is q/k's already


def test_the_backward_copies_do_with_misaligned_rows_only_where_the_narrow_tile_is_kept():
    q, k = torch.randn(1, 2, 8, 40), torch.randn(1, 2, 8, 40)
    misaligned = torch.randn(1, 2, 8, 32 + 3)[..., 3:]
    narrow = prepare(q, k, torch.randn(1, 2, 8, 32), validate_forward(q, k, torch.randn(1, 2, 8, 32)))
    assert narrow.block_dv == 32
    copied = aligned_value_rows(misaligned, narrow)
    assert copied is not misaligned and copied.is_contiguous() and torch.equal(copied, misaligned)
    assert aligned_value_rows(narrow.v, narrow) is narrow.v
    widened = prepare(q, k, misaligned, validate_forward(q, k, misaligned))
    assert widened.block_dv == 64 and aligned_value_rows(misaligned, widened) is misaligned


def _gpu_launch_path_on_the_cpu(monkeypatch) -> PreparedCall:
    """A prepared call whose ``launch.run`` takes the GPU path (chosen configs, fallbacks) with a fresh tuner, no
    stored winners, tuning off (the heuristic pick is the choice: here the first candidate, 128x64 w8 s3, as neither
    Gluon nor TMA is in scope) and no shared-memory pruning."""
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "0")
    monkeypatch.setattr(launch_module, "triton_interpreter_active", lambda: False)
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 10**9)
    monkeypatch.setattr(tuning, "_device_identity", lambda index: None)
    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    q = torch.randn(1, 1, 8, 16)
    return prepare(q, q, q, validate_forward(q, q, q, scale=0.25))


def test_autotuned_launch_falls_back_when_a_config_does_not_fit(monkeypatch):
    """The GPU path of launch.run, driven on the CPU with a fake launch: autotuning off, the heuristic pick runs
    out of shared memory, the next candidate runs, and every launch is preceded by a reset."""
    from triton.runtime.errors import OutOfResources

    call = _gpu_launch_path_on_the_cpu(monkeypatch)
    events = []
    first = tuning.CANDIDATES["forward"][0]
    assert tuning.heuristic_pick("forward", call.block_d, tuning.CANDIDATES["forward"][:7]) == first
    too_big = {first}

    def launch(cfg):
        events.append(("launch", cfg))
        if cfg in too_big:
            raise OutOfResources(1, 0, "shared memory")

    def run(reset=None):
        return launch_module.run(call, KernelVariant.FORWARD, launch, reset=reset)

    used = run(reset=lambda: events.append(("reset", None)))
    assert used == tuning.CANDIDATES["forward"][1]
    assert events == [("reset", None), ("launch", first), ("reset", None), ("launch", used)]
    events.clear()
    assert run(reset=lambda: events.append(("reset", None))) == used  # remembered
    assert events == [("reset", None), ("launch", used)]
    # A later call of the same key that no longer fits the remembered config (another specialisation): the next
    # candidate that fits runs, and is remembered.
    too_big.add(used)
    after = tuning.CANDIDATES["forward"][2]
    assert run() == after and list(tuning.AUTOTUNER.best.values()) == [after]


def test_a_key_where_no_config_fits_fails_the_same_way_every_time(monkeypatch):
    """When no candidate can launch, every call raises the same RuntimeError: no config is remembered as tuned."""
    from triton.runtime.errors import OutOfResources

    call = _gpu_launch_path_on_the_cpu(monkeypatch)

    def launch(cfg):
        raise OutOfResources(1, 0, "shared memory")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="no launch configuration of forward fits"):
            launch_module.run(call, KernelVariant.FORWARD, launch)
    assert tuning.AUTOTUNER.best == {}


def test_grids_count_the_tiles_that_cover_a_sequence():
    assert [launch_module.num_blocks(n, 64) for n in (1, 63, 64, 65, 128, 1000)] == [1, 1, 1, 2, 2, 16]


def test_launch_keys_use_the_next_power_of_two():
    """The head-dim tile and the autotuner's sequence-length buckets are powers of two, clamped: 16 <= BLOCK_D and
    64 <= bucket <= 16384 (computed in integer arithmetic, per launch)."""
    for n in [0, 1, 2, 3, 63, 64, 65, 1000, 1024, 1025, 16383, 16384, 16385, 100_000]:
        bucket = tuning.seqlen_bucket(n)
        assert bucket == min(max(64, 2 ** math.ceil(math.log2(max(n, 1)))), 16384)
    for d in [1, 15, 16, 17, 64, 80, 96, 128, 129, 256]:
        assert tuning.head_dim_tile(d) == max(16, 2 ** math.ceil(math.log2(d)))


def test_the_five_product_dq_buffer_is_read_back_in_row_order():
    # The Gluon five-product block stores row q of each group of 8 of its dQ shares at 2q mod 8 + q div 4 (the
    # 128-byte swizzle would put rows q and q ^ 1 on the same shared-memory banks); the conversion undoes it.
    from attnzoo.kernels.backward_gluon import dq_staging_order

    B, H, padded, nq, D = 2, 3, 64, 50, 80
    dq = torch.randn(B, H, padded, D, dtype=torch.float32, device=DEVICE)
    # The buffer as the kernel's reductions leave it: each tile stored through the view `_staging_rows` takes
    # (reshape [rows / 8, 2, 2, 2, D], permute (0, 3, 1, 2, 4)), here with the batch and head dims in front.
    staged = torch.full_like(dq, float("nan"))
    groups = (B, H, padded // 8, 2, 2, 2, D)
    staged.view(groups).permute(0, 1, 2, 5, 3, 4, 6).copy_(dq.view(groups))
    row = torch.arange(8)
    assert torch.equal(staged[0, 0, (2 * row) % 8 + row // 4], dq[0, 0, :8])  # row q of each 8 at 2q mod 8 + q div 4
    out = dq_staging_order(staged, nq, torch.float16)
    assert out.dtype == torch.float16 and out.shape == (B, H, nq, D) and out.is_contiguous()
    torch.testing.assert_close(out, dq[:, :, :nq].half(), rtol=0, atol=0)
