"""SPEC.md, "Score modifiers" and "`v` may have its own head dim": the semantics, checked without the oracle where
possible, and the oracle itself checked against independent implementations (SDPA with an additive bias, autograd).

The property suite (test_properties.py) then judges every backend against the oracle over random combinations.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases import BF16, F16, F32, REFERENCE_BACKENDS, cases, run_if_supported
from hypothesis import assume, event, given
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.backend import FEATURE_NAMES, SCORE_MODIFIER_FEATURES
from attnzoo.backends._tiles import key_band, tile_is_empty, tile_visibility
from attnzoo.kernels.forward_gluon import SOFTCAP_FIXED_MAX, SOFTCAP_RUNNING_MAX, softcap_form
from attnzoo.kernels.launch import prepare
from attnzoo.validation import validate_forward

F64 = torch.float64


def _randn(gen: torch.Generator, *shape: int, dtype=F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _spec_bias(B, H, Nq, Nk, causal, window, seqlens_k, alibi_slopes) -> torch.Tensor:
    """The additive bias of SPEC.md written element by element: ALiBi's ``-slope * |i' - j|`` on visible pairs,
    ``-inf`` on hidden ones.  Slow on purpose: nothing shared with the oracle's vectorised code."""
    bias = torch.zeros(B, H, Nq, Nk, dtype=F64)
    for b in range(B):
        for h in range(H):
            slope = (
                0.0
                if alibi_slopes is None
                else float(alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h])
            )
            for i in range(Nq):
                i_aligned = i + (Nk - Nq)
                for j in range(Nk):
                    visible = j < (Nk if seqlens_k is None else int(seqlens_k[b]))
                    visible &= not causal or j <= i_aligned
                    if window is not None:
                        left, right = window
                        visible &= left is None or i_aligned - left <= j
                        visible &= right is None or j <= i_aligned + right
                    bias[b, h, i, j] = -slope * abs(i_aligned - j) if visible else -math.inf
    return bias


@pytest.mark.parametrize(
    "seed, causal, window, alibi",
    [
        (1, False, (4, 2), "heads"),
        (2, True, (None, -5), "batch-heads"),  # with causal, rows 0.. see keys j <= i' - 5: row 0 sees none
        (3, False, (-2, 9), None),  # keys ahead of the row only: the last rows see none
        (4, True, None, "heads"),
    ],
)
def test_oracle_matches_sdpa_with_the_spec_bias(seed, causal, window, alibi):
    """Window, causal, padding and ALiBi as SDPA's additive float mask; GQA; Dv != D; outputs and gradients."""
    B, H, Hkv, Nq, Nk, D, Dv = 2, 4, 2, 7, 11, 6, 5
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _randn(gen, B, H, Nq, D), _randn(gen, B, Hkv, Nk, D), _randn(gen, B, Hkv, Nk, Dv)
    do = _randn(gen, B, H, Nq, Dv)
    seqlens = torch.tensor([11, 8])
    slopes = None if alibi is None else torch.rand((H,) if alibi == "heads" else (B, H), generator=gen).float()
    bias = _spec_bias(B, H, Nq, Nk, causal, window, seqlens, slopes)
    has_key = torch.isfinite(bias).any(-1)
    ref = oracle.reference(q, k, v, do, causal, 0.4, seqlens, window=window, alibi_slopes=slopes)

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    # SDPA gives NaN on a row with no visible key; SPEC.md gives o = 0 and zero gradient: compare the others.
    o = F.scaled_dot_product_attention(
        qg, kg.repeat_interleave(H // Hkv, 1), vg.repeat_interleave(H // Hkv, 1), attn_mask=bias, scale=0.4
    )
    o = torch.where(has_key[..., None], o, 0.0)
    dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
    torch.testing.assert_close(ref.o, o, atol=1e-12, rtol=1e-10)
    for got, expected in ((ref.dq, dq), (ref.dk, dk), (ref.dv, dv)):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    assert torch.equal(torch.isneginf(ref.lse), ~has_key)


def test_oracle_backward_matches_autograd_with_every_modifier():
    """The oracle's explicit backward (1 - tanh^2 for the soft cap, no gradient through ALiBi) against autograd
    through the same formulas (plain_torch in float64), fully-masked rows included."""
    B, H, Hkv, Nq, Nk, D, Dv = 2, 6, 2, 9, 13, 8, 3
    gen = torch.Generator().manual_seed(25)
    q, k, v = _randn(gen, B, H, Nq, D), _randn(gen, B, Hkv, Nk, D), _randn(gen, B, Hkv, Nk, Dv)
    do = _randn(gen, B, H, Nq, Dv)
    kw = dict(causal=True, scale=1.3, seqlens_k=torch.tensor([13, 0]), window=(5, -1), softcap=0.8)
    kw["alibi_slopes"] = torch.rand(B, H, generator=gen).float()
    ref, auto = oracle.reference(q, k, v, do, **kw), oracle.plain_torch(q, k, v, do, **kw)
    assert torch.isneginf(ref.lse[1]).all() and torch.isfinite(ref.lse[0, :, 1:]).all()
    for name in ("o", "dq", "dk", "dv"):
        torch.testing.assert_close(getattr(ref, name), getattr(auto, name), atol=1e-12, rtol=1e-10)


def test_causal_is_a_window():
    """Bottom-right causal is window (None, 0); SDPA's top-left is_causal is window (None, Nq - Nk)."""
    gen = torch.Generator().manual_seed(4)
    for Nq, Nk in ((5, 12), (12, 5)):
        q, k, v = _randn(gen, 1, 2, Nq, 4), _randn(gen, 1, 2, Nk, 4), _randn(gen, 1, 2, Nk, 4)
        causal = oracle.reference(q, k, v, causal=True)
        as_window = oracle.reference(q, k, v, window=(None, 0))
        assert torch.equal(causal.o, as_window.o) and torch.equal(causal.lse, as_window.lse)
        top_left = oracle.reference(q, k, v, window=(None, Nq - Nk))
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        visible = torch.isfinite(top_left.lse)  # Nq > Nk: SDPA gives NaN rows where no key is visible
        torch.testing.assert_close(top_left.o[visible], sdpa[visible], atol=1e-12, rtol=1e-10)


def test_window_sides_beyond_the_sequences_change_nothing():
    """Sides are clamped to +-(Nq + Nk) by validation, which selects the same keys."""
    q, k = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 9, 4)
    for window in ((2**40, 3), (-(2**40), None), (None, 2**40), (16, -16), (-15, 15), (np.int64(-(2**62)), 0)):
        problem = validate_forward(q, k, k, window=window)
        exact = oracle.visible_mask(1, 6, 9, False, None, window=tuple(None if w is None else int(w) for w in window))
        assert torch.equal(oracle.visible_mask(1, 6, 9, False, None, window=problem.window), exact), window
    assert validate_forward(q, k, k, window=(None, None)).window is None


@pytest.mark.parametrize("name", ["triton_2kernel", "triton_atomic"])
def test_a_window_that_hides_no_key_runs_the_kernels_of_the_call_without_it(name):
    """A side at or past the score matrix's last diagonal (left >= Nk - 1, right >= Nq - 1) hides no key: the
    Triton kernels run as for the call without it (bitwise the same o, lse and gradients), under its tuning key."""
    pytest.importorskip("triton")
    backend = attnzoo.get(name)
    gen = torch.Generator().manual_seed(11)
    q, k, v, do = (_randn(gen, 1, 2, n, 16, dtype=F32) for n in (24, 40, 40, 24))
    for causal, window in ((True, (39, 0)), (True, (10**6, 5)), (False, (39, 23)), (False, (None, 10**6))):
        o, lse = backend.forward(q, k, v, causal=causal, window=window)
        o_plain, lse_plain = backend.forward(q, k, v, causal=causal)
        assert torch.equal(o, o_plain) and torch.equal(lse, lse_plain), window
        grads = backend.backward(do, q, k, v, o, lse, causal=causal, window=window)
        for got, plain in zip(grads, backend.backward(do, q, k, v, o, lse, causal=causal), strict=True):
            assert torch.equal(got, plain), window
        assert prepare(q, k, v, validate_forward(q, k, v, causal, None, None, window)).modifiers.key == ""


def _backends_running(feature: str) -> list[str]:
    """The registered backends that declare ``feature`` and run float32 CPU tensors here (Triton: in the
    interpreter); the others are covered by ``test_a_modifier_a_backend_lacks_is_named_in_its_reasons``."""
    x = torch.ones(1, 1, 1, 8)
    return [
        name
        for name in attnzoo.names()
        if feature in attnzoo.get(name).capabilities.features and not attnzoo.get(name).not_supported_reasons(x, x, x)
    ]


@pytest.mark.parametrize("name", _backends_running("alibi"))
def test_alibi_by_hand(name):
    """With scale 0 every raw score is 0, so P is ALiBi's alone: row i weighs key j by exp(-slope * |i' - j|), with
    i' = i + (Nk - Nq).  Nq = 2, Nk = 3: row 0 is at position 1, row 1 at position 2 (bottom-right)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, n, 4, generator=gen) for h, n in ((2, 2), (1, 3), (1, 3)))
    slopes = torch.tensor([0.5, 2.0])
    o, lse = attnzoo.get(name).forward(q, k, v, scale=0.0, alibi_slopes=slopes)
    for h, slope in enumerate(slopes.tolist()):
        for i, distances in enumerate(([1, 0, 1], [2, 1, 0])):
            weights = torch.exp(-slope * torch.tensor(distances, dtype=F64))
            expected = (weights / weights.sum()) @ v[0, 0].double()
            torch.testing.assert_close(o[0, h, i].double(), expected, atol=1e-6, rtol=1e-6)
            assert abs(float(lse[0, h, i]) - math.log(float(weights.sum()))) < 1e-6


@pytest.mark.parametrize("name", _backends_running("softcap"))
def test_softcap_bounds_every_score(name):
    """|S| <= softcap after the cap, so lse lies within log(Nk) +- softcap however large the raw scores."""
    gen = torch.Generator().manual_seed(10)
    q, k = torch.randn(2, 2, 17, 8, generator=gen), torch.randn(2, 2, 23, 8, generator=gen)
    softcap = 0.5
    _, lse = attnzoo.get(name).forward(q, k, k, scale=40.0, softcap=softcap)
    assert (lse - math.log(23)).abs().max() <= softcap + 1e-5
    _, uncapped = attnzoo.get(name).forward(q, k, k, scale=40.0)
    assert (uncapped - math.log(23)).abs().max() > 10 * softcap, "the raw scores must be large for this to test"


@pytest.mark.parametrize(
    ("dtype", "softcap", "alibi", "form"),
    [
        (BF16, 30.0, False, SOFTCAP_FIXED_MAX),
        (BF16, 33.2, False, SOFTCAP_FIXED_MAX),
        (BF16, 33.4, False, SOFTCAP_RUNNING_MAX),  # 2^(-2 c log2(e)) would pass 2^-96
        (BF16, 5.0, True, SOFTCAP_RUNNING_MAX),  # ALiBi's terms can lift a score above the cap
        (F16, 30.0, False, SOFTCAP_RUNNING_MAX),  # float16's P holds nothing below 2^-24
        (BF16, 0.0, False, 0),
    ],
)
def test_the_gluon_forward_fixes_the_max_at_the_cap_only_where_p_holds_every_score(dtype, softcap, alibi, form):
    """The Gluon forward's soft cap takes ``c`` as every row's softmax max (no running max) only where a P of
    ``exp(-2c)`` is still a normal number of P's dtype, with room below it for the products P V."""
    q = torch.randn(1, 2, 8, 64, dtype=dtype)
    slopes = torch.tensor([0.5, 0.25]) if alibi else None
    call = prepare(q, q, q, validate_forward(q, q, q, softcap=softcap, alibi_slopes=slopes))
    assert softcap_form(call.modifiers, dtype) == form


@pytest.mark.parametrize("name", [n for n in REFERENCE_BACKENDS if n in attnzoo.names()])
def test_gradcheck_float64_with_every_modifier(name):
    """Finite differences against the backward: the soft cap's 1 - tanh^2, the window, ALiBi, Dv != D, GQA."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 6, 5, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 8, 5, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 8, 3, dtype=F64, generator=gen, requires_grad=True)
    kw = dict(causal=True, seqlens_k=torch.tensor([8, 5]), window=(3, None), softcap=0.9)
    kw["alibi_slopes"] = torch.rand(4, generator=gen).float()

    def f(q, k, v):
        return attnzoo.attention(q, k, v, scale=0.8, **kw, backend=name)

    # The backward reads the float32 lse of the contract, so the analytic gradient is float32-accurate.
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", _backends_running("alibi"))
def test_alibi_slopes_get_no_gradient(name):
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, generator=gen).requires_grad_()
    attnzoo.attention(q, k, v, alibi_slopes=slopes, backend=name).square().sum().backward()
    assert slopes.grad is None and all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))


MODIFIER_ARGS = {
    "window": dict(window=(3, 0)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slopes=torch.full((2,), 0.5)),
    "head_dim_v": dict(v=torch.randn(1, 1, 8, 24)),
}


@pytest.mark.parametrize("feature", sorted(SCORE_MODIFIER_FEATURES))
@pytest.mark.parametrize("name", attnzoo.names())
def test_a_modifier_a_backend_lacks_is_named_in_its_reasons(name, feature):
    """Declared unsupported: named in not_supported_reasons, and forward raises NotImplementedError with it."""
    backend = attnzoo.get(name)
    if feature in backend.capabilities.features:
        pytest.skip(f"{name} declares {feature}")
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16)
    args = {"q": q, "k": k, "v": k, **MODIFIER_ARGS[feature]}
    reasons = backend.not_supported_reasons(**args)
    assert any(FEATURE_NAMES[feature] in r for r in reasons), reasons
    with pytest.raises(NotImplementedError, match=re.escape(FEATURE_NAMES[feature])):
        backend.forward(**args)


@given(data=st.data())
def test_tiles_are_skipped_exactly_when_no_pair_is_visible(data):
    """The blocked backends' tile test against SPEC.md's mask: a tile is skipped iff causal and the window leave none
    of its (row, key) pairs visible, or all its keys are padding in every batch (so a tile outside the window is
    never loaded); a skipped tile holds no visible pair; the mask of a kept tile is the mask's block."""
    Nq, Nk = data.draw(st.integers(1, 40), label="Nq"), data.draw(st.integers(1, 40), label="Nk")
    block_m, block_n = data.draw(st.sampled_from([(8, 8), (16, 4), (5, 7)]), label="blocks")
    side = st.one_of(st.none(), st.integers(-Nk - 3, Nk + 3))
    window = data.draw(st.one_of(st.none(), st.tuples(side, side)), label="window")
    causal = data.draw(st.booleans(), label="causal")
    seqlens = torch.tensor(data.draw(st.lists(st.integers(0, Nk), min_size=1, max_size=3), label="seqlens_k"))
    mask = oracle.visible_mask(len(seqlens), Nq, Nk, causal, seqlens, window=window)[:, 0]
    band_mask = oracle.visible_mask(1, Nq, Nk, causal, None, window=window)[:, 0]
    band = key_band(causal, window)
    min_len, max_len = int(seqlens.min()), int(seqlens.max())
    for m0 in range(0, Nq, block_m):
        m1 = min(m0 + block_m, Nq)
        for n0 in range(0, Nk, block_n):
            n1 = min(n0 + block_n, Nk)
            block = mask[:, m0:m1, n0:n1]
            skipped = tile_is_empty(m0, m1, n0, n1, Nq, Nk, band, max_len)
            assert skipped == (not band_mask[:, m0:m1, n0:n1].any() or n0 >= max_len), (m0, n0)
            assert not (skipped and block.any()), (m0, n0)
            visible = tile_visibility(torch, m0, m1, n0, n1, Nq, Nk, band, seqlens, min_len)
            visible = torch.ones_like(block) if visible is None else visible[:, 0, 0].expand_as(block)
            assert torch.equal(visible, block), (m0, n0)
            if skipped:
                event("some tile skipped")


@pytest.mark.gpu
@pytest.mark.parametrize("name", attnzoo.names())
@given(data=st.data())
def test_score_modifiers_against_oracle_on_gpu(name, data):
    """On the GPU, every CUDA backend on random cases that use at least one score modifier it declares."""
    backend = attnzoo.get(name)
    if "cuda" not in backend.capabilities.devices or not backend.capabilities.features & SCORE_MODIFIER_FEATURES:
        pytest.skip(f"{name} declares no score modifier on CUDA")
    case = data.draw(cases(dtypes=(F32, F16, BF16), features=backend.capabilities.features), label="case")
    assume(case.modifiers)
    assert run_if_supported(backend, case, "cuda")
    for modifier in sorted(case.modifiers):
        event(modifier)
