"""SPEC.md, "Merging partial results": ``merge_attention`` of attention over disjoint key sets equals attention over
their union, rows that see no key in a part (or in any part) included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.testing import random_inputs

F64 = torch.float64


def _part(q, k, v, keys: torch.Tensor, causal_offset: int | None):
    """Exact (o, lse) of q over the keys ``keys`` (indices into Nk) in float64; with ``causal_offset`` the causal
    mask of the full problem (row i sees key j iff j <= i + offset) is kept, so that some rows see nothing."""
    s = (q.to(F64) @ k.to(F64)[:, :, keys].transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal_offset is not None:
        rows = torch.arange(q.shape[2]).view(-1, 1)
        s = s.masked_fill(keys.view(1, -1) > rows + causal_offset, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse).unsqueeze(-1))
    return p @ v.to(F64)[:, :, keys], lse


@settings(deadline=None, max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    n_q=st.integers(1, 9),
    n_k=st.integers(1, 40),
    parts=st.integers(1, 5),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_merge_of_random_key_splits_equals_the_unsplit_result(seed, n_q, n_k, parts, causal, dtype):
    x = random_inputs(2, 3, 3, n_q, n_k, 8, dtype=F64, seed=seed, with_do=False)
    gen = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, parts, (n_k,), generator=gen)  # a random partition; some parts may be empty of keys
    offset = n_k - n_q if causal else None
    o_parts, lse_parts = [], []
    for p in range(parts):
        keys = torch.nonzero(owner == p).flatten()
        o_p, lse_p = _part(x.q, x.k, x.v, keys, offset)
        o_parts.append(o_p.to(dtype))
        lse_parts.append(lse_p.to(dtype))
    o, lse = attnzoo.merge_attention(o_parts, lse_parts)
    want = oracle.reference(x.q, x.k, x.v, causal=causal)
    tol = 1e-12 if dtype == F64 else 2e-6
    assert o.dtype == dtype and lse.dtype == dtype
    torch.testing.assert_close(o.to(F64), want.o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.to(F64), want.lse, atol=tol, rtol=tol)


def test_rows_with_no_key_in_any_part_are_zero_with_minus_inf_lse():
    o_parts = torch.zeros(3, 1, 2, 4, 5)
    lse_parts = torch.full((3, 1, 2, 4), -math.inf)
    lse_parts[1, 0, 0, 0] = 0.5
    o_parts[1, 0, 0, 0] = 1.0
    o, lse = attnzoo.merge_attention(o_parts, lse_parts)
    assert torch.equal(o[0, 0, 0], torch.ones(5)) and lse[0, 0, 0] == 0.5
    assert torch.equal(o[0, 0, 1:], torch.zeros(3, 5)) and torch.all(lse[0, 0, 1:] == -math.inf)
    assert torch.equal(o[0, 1], torch.zeros(4, 5)) and not torch.isnan(o).any()


def test_nan_in_a_visible_part_reaches_the_output():
    o_parts = torch.randn(2, 3, 4)
    lse_parts = torch.randn(2, 3)
    o_parts[0, 1, 2] = float("nan")
    o, _lse = attnzoo.merge_attention(o_parts, lse_parts)
    assert torch.isnan(o[1, 2]) and not torch.isnan(o[0]).any() and not torch.isnan(o[2]).any()


def test_gradients_match_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(3)
    o_parts = torch.randn(3, 2, 5, 4, generator=gen, dtype=F64, requires_grad=True)
    lse_parts = torch.randn(3, 2, 5, generator=gen, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(attnzoo.merge_attention, (o_parts, lse_parts))


@pytest.mark.parametrize(
    "o_parts, lse_parts, error, match",
    [
        (torch.zeros(2, 3, 4), torch.zeros(2, 4), ValueError, "agree on"),
        (torch.zeros(0, 3, 4), torch.zeros(0, 3), ValueError, "P >= 1"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.float16), TypeError, "lse_parts"),
        (torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3), TypeError, "o_parts"),
        ([torch.zeros(3, 4), torch.zeros(2, 4)], torch.zeros(2, 3), ValueError, "same shape"),
        ("o", torch.zeros(2, 3), TypeError, "o_parts"),
    ],
)
def test_bad_input_names_the_argument(o_parts, lse_parts, error, match):
    with pytest.raises(error, match=match):
        attnzoo.merge_attention(o_parts, lse_parts)
