"""``attnzoo.testing``: the input factory and the oracle check that the tests, ``compare`` and ``bench`` share, and
the chunked oracle of the GPU tests (checked here on the CPU against the whole-matrix one)."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo import oracle
from attnzoo.testing import LAYOUTS, AttentionInputs, check_backend, oracle_for, random_inputs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inputs_are_fresh_random_in_the_asked_layout(layout):
    x = random_inputs(2, 4, 2, 17, 23, 24, dtype=torch.float16, seed=3, seqlens_k=[23, 5], layout=layout)
    assert x.q.shape == (2, 4, 17, 24) and x.k.shape == x.v.shape == (2, 2, 23, 24) and x.do.shape == x.q.shape
    assert all(t.dtype == torch.float16 and t.count_nonzero() == t.numel() for t in (x.q, x.k, x.v, x.do))
    assert x.seqlens_k.dtype == torch.int32 and x.seqlens_k.tolist() == [23, 5]
    assert not torch.equal(x.k, x.v)
    strides = {
        "contiguous": x.q.is_contiguous(),
        "bnhd": x.q.stride()[1:3] == (24, 4 * 24),
        "padded": x.q.stride(-2) == 32,
        "broadcast": x.q.stride(1) == 0,
    }
    assert strides[layout]
    again = random_inputs(2, 4, 2, 17, 23, 24, dtype=torch.float16, seed=3, layout=layout)
    other = random_inputs(2, 4, 2, 17, 23, 24, dtype=torch.float16, seed=4, layout=layout)
    assert torch.equal(again.q, x.q) and not torch.equal(other.q, x.q)
    assert random_inputs(1, 1, 1, 4, 4, 8, with_do=False).do is None
    with pytest.raises(ValueError, match="layout"):
        random_inputs(1, 1, 1, 4, 4, 8, layout="nhd")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_the_chunked_oracle_gives_the_whole_matrix_results(dtype):
    x = random_inputs(2, 6, 2, 19, 29, 16, dtype=dtype, seed=1, seqlens_k=[29, 0])
    args = (x.q, x.k, x.v, x.do, True, 0.3, x.seqlens_k)
    pairs = [(oracle.reference(*args), oracle.reference_chunked(*args, device="cpu"))]
    stored = dict(stored_dtype=torch.float16, stored_o=x.q)
    pairs.append((oracle.reference(*args, **stored), oracle.reference_chunked(*args, **stored, device="cpu")))
    whole_base, chunked_base = oracle.plain_torch(*args), oracle.plain_torch_chunked(*args)
    for whole, chunked in pairs:
        for name in ("o", "lse", "dq", "dk", "dv"):
            torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=1e-12, atol=1e-12)
    # Plain PyTorch per head rounds as on the whole batch, up to the order of its float32 sums; dk and dv add the
    # group's heads in float64 instead of the input dtype.
    tol = 1e-12 if dtype == torch.float64 else 4e-3
    for name in ("o", "lse", "dq", "dk", "dv"):
        got, want = getattr(chunked_base, name).double(), getattr(whole_base, name).double()
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_the_check_passes_a_backend_and_fails_a_wrong_output():
    x = random_inputs(1, 4, 2, 33, 40, 16, dtype=torch.float16, seed=2, seqlens_k=[31])
    backend = attnzoo.get("torch_fa2")
    outputs, checks = check_backend(backend, x, causal=True)
    assert set(checks) == {"o", "lse", "dq", "dk", "dv"} and all(c.ok for c in checks.values()), checks
    chunked = oracle_for(x, causal=True, chunked=True).check(outputs)
    assert {n: c.error for n, c in chunked.items()} == pytest.approx({n: c.error for n, c in checks.items()})
    for name in ("o", "lse", "dq"):  # dk and dv: the baseline's group sum differs (see above), and so their bound
        assert chunked[name].bound == pytest.approx(checks[name].bound)
    judge = oracle_for(x, causal=True)
    assert not judge.check({"dk": outputs["dk"] * 1.01}, stored_o=outputs["o"])["dk"].ok
    forward_only = oracle_for(AttentionInputs(x.q, x.k, x.v, None, x.seqlens_k), causal=True)
    assert set(forward_only.check({"o": outputs["o"], "lse": outputs["lse"]})) == {"o", "lse"}
    lse = outputs["lse"].clone()
    lse[0, 0, 0] = float("nan")
    assert not forward_only.check({"lse": lse})["lse"].ok
