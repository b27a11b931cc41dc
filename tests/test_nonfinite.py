"""SPEC.md, "Semantics": a NaN in q, k or v reaches the rows it touches as NaN on every backend, never hidden as a
zero or a fully-masked row; float64 inputs get a float64 lse, and the reference backends are exact end to end.

Which rows a NaN touches (SPEC.md): a NaN in row i of q touches query row i; a NaN in row j of k or v touches every
query row that sees key j (causal and seqlens_k decide).  A touched row has NaN in ``o`` (in the NaN's column for v)
and in ``dq``, and NaN in ``lse`` unless the NaN is in v; the keys a touched row sees get NaN in ``dk``.  A row no NaN
touches keeps finite ``o`` and ``lse`` when the NaN is in q or k.  (A NaN in v may also reach rows of the same tile
that do not see it, through ``0 * NaN`` in ``P @ V``; the contract does not fix them.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.backend import triton_interpreter_active

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runs_float32(name: str) -> bool:
    x = torch.ones(1, 1, 1, 16, device=DEVICE)
    return not attnzoo.get(name).not_supported_reasons(x, x, x)


FLOAT32_BACKENDS = [name for name in attnzoo.names() if _runs_float32(name)]
REFERENCE_BACKENDS = [n for n in attnzoo.names() if torch.float64 in attnzoo.get(n).capabilities.dtypes]


@st.composite
def nan_cases(draw):
    """A small random case with one NaN at a random element of q, k or v."""
    B, Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Nq, Nk, D = draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.sampled_from([4, 16]))
    causal = draw(st.booleans())
    seqlens = draw(st.none() | st.lists(st.integers(0, Nk), min_size=B, max_size=B))
    where = draw(st.sampled_from(["q", "k", "v"]))
    heads, rows = (Hkv * group, Nq) if where == "q" else (Hkv, Nk)
    position = (draw(st.integers(0, B - 1)), draw(st.integers(0, heads - 1)), draw(st.integers(0, rows - 1)))
    column = draw(st.integers(0, D - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    return (B, Hkv * group, Hkv, Nq, Nk, D), causal, seqlens, where, position, column, seed


def _inputs(shape, seqlens, where, position, column, seed):
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, H, Nq, D, generator=gen),
        "k": torch.randn(B, Hkv, Nk, D, generator=gen),
        "v": torch.randn(B, Hkv, Nk, D, generator=gen),
        "do": torch.randn(B, H, Nq, D, generator=gen),
    }
    x[where][(*position, column)] = float("nan")
    lens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    return {name: t.to(DEVICE) for name, t in x.items()}, None if lens is None else lens.to(DEVICE)


def _touched(shape, causal, seqlens, where, position) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``[B, H, Nq]``: the query rows the NaN touches; and ``[B, Hkv, Nk]``: the keys those rows see."""
    B, H, Hkv, Nq, Nk, _ = shape
    lens = None if seqlens is None else torch.tensor(seqlens)
    visible = oracle.visible_mask(B, Nq, Nk, causal, lens).expand(B, H, Nq, Nk)
    b, h, n = position
    rows = torch.zeros(B, H, Nq, dtype=torch.bool)
    if where == "q":
        rows[b, h, n] = bool(visible[b, h, n].any())
    else:  # every query head of the K/V head's group, every row that sees key n
        group = H // Hkv
        rows[b, h * group : (h + 1) * group] = visible[b, h * group : (h + 1) * group, :, n]
    seen_keys = (visible & rows[..., None]).reshape(B, Hkv, H // Hkv, Nq, Nk).any(dim=(2, 3))
    return rows, seen_keys


@pytest.mark.parametrize("name", FLOAT32_BACKENDS)
@given(case=nan_cases())
@settings(max_examples=12 if triton_interpreter_active() else 40, deadline=None)
def test_a_nan_in_q_k_or_v_reaches_every_row_it_touches(name, case):
    shape, causal, seqlens, where, position, column, seed = case
    x, lens = _inputs(shape, seqlens, where, position, column, seed)
    backend = attnzoo.get(name)
    o, lse = backend.forward(x["q"], x["k"], x["v"], causal=causal, seqlens_k=lens)
    dq, dk, _ = backend.backward(x["do"], x["q"], x["k"], x["v"], o, lse, causal=causal, seqlens_k=lens)
    o, lse, dq, dk = (t.cpu() for t in (o, lse, dq, dk))
    rows, seen_keys = _touched(shape, causal, seqlens, where, position)

    o_nan = o[..., column].isnan() if where == "v" else o.isnan().all(dim=-1)
    assert bool(o_nan[rows].all()), "a touched row's o is not NaN"
    assert bool(dq.isnan().all(dim=-1)[rows].all()), "a touched row's dq is not NaN"
    assert bool(dk.isnan().all(dim=-1)[seen_keys].all()), "a key seen by a touched row has no NaN in dk"
    if where == "v":
        assert not lse.isnan().any(), "a NaN in v reached lse"
    else:
        assert torch.equal(lse.isnan(), rows), "lse is NaN exactly on the touched rows"
        assert torch.equal(o.isnan().any(dim=-1), rows), "o is NaN exactly on the touched rows"
    # A row that sees no key stays a fully-masked row (o = 0, lse = -inf); a touched row never looks like one.
    assert not bool(lse.isneginf()[rows].any())


@pytest.mark.parametrize("name", REFERENCE_BACKENDS)
@given(case=nan_cases())
@settings(max_examples=25, deadline=None)
def test_float64_inputs_get_a_float64_lse_and_gradients_exact_to_1e_12(name, case):
    shape, causal, seqlens, *_, seed = case
    gen = torch.Generator().manual_seed(seed)
    B, H, Hkv, Nq, Nk, D = shape
    q, do = (torch.randn(B, H, Nq, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Nk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    lens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    backend = attnzoo.get(name)
    o, lse = backend.forward(q, k, v, causal=causal, seqlens_k=lens)
    assert lse.dtype == torch.float64
    grads = backend.backward(do, q, k, v, o, lse, causal=causal, seqlens_k=lens)
    ref = oracle.reference(q, k, v, do, causal=causal, seqlens_k=lens)
    assert ref.lse.dtype == torch.float64
    no_key = ref.lse.isneginf()
    assert torch.equal(lse.isneginf(), no_key)
    for got, want in ((o, ref.o), (lse[~no_key], ref.lse[~no_key]), *zip(grads, (ref.dq, ref.dk, ref.dv), strict=True)):
        if want.numel():
            magnitude = max(1.0, float(want.abs().max()))
            assert float((got - want).abs().max()) <= 1e-12 * magnitude


def test_backward_takes_float32_lse_for_float32_inputs_and_float64_for_float64():
    backend = attnzoo.get("torch_fa2")
    for dtype, wrong in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        q = torch.randn(1, 1, 4, 8, dtype=dtype)
        o, lse = backend.forward(q, q, q)
        with pytest.raises(TypeError, match="lse must be"):
            backend.backward(torch.randn_like(q), q, q, q, o, lse.to(wrong))
