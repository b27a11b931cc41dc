"""SPEC.md, the SDPA drop-in: ``attnzoo.sdpa`` has ``scaled_dot_product_attention``'s exact signature and semantics,
runs attnzoo where the call is expressible and torch's SDPA otherwise; ``sdpa_patched`` swaps it in for a block."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from tiny_gpt import assert_within_rule, train

import attnzoo
from attnzoo import drop_in as sdpa_module


def _qkv(B=2, H=4, Hkv=4, Nq=24, Nk=24, D=16, Dv=None, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, Dv or D, generator=gen, dtype=dtype)
    return q, k, v


def test_signature_is_torchs():
    ours = inspect.signature(attnzoo.sdpa)
    params = [(p.name, p.default) for p in ours.parameters.values()]
    assert params == [
        ("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty), ("value", inspect.Parameter.empty),
        ("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None), ("enable_gqa", False),
    ]  # fmt: skip


def _runs_attnzoo(monkeypatch) -> list:
    """Record the calls that reach attnzoo.attention through sdpa."""
    calls = []
    real = sdpa_module.attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa_module, "attention", spy)
    return calls


@pytest.mark.parametrize(
    "shape, kwargs",
    [
        (dict(), dict()),
        (dict(), dict(is_causal=True, scale=0.3)),
        (dict(H=6, Hkv=2), dict(is_causal=True, enable_gqa=True)),
        (dict(Nq=5, Nk=31), dict()),
        (dict(Nq=5, Nk=31), dict(is_causal=True)),  # top-left causal: the window (None, Nq - Nk)
        (dict(Nq=31, Nk=5), dict(is_causal=True)),
        (dict(Dv=24), dict(is_causal=True)),
    ],
)
def test_expressible_calls_run_attnzoo_and_match_torch(monkeypatch, shape, kwargs):
    q, k, v = (x.double().requires_grad_() for x in _qkv(**shape))
    calls = _runs_attnzoo(monkeypatch)
    ours = attnzoo.sdpa(q, k, v, **kwargs)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = torch.autograd.grad(theirs.square().sum(), (q, k, v))
    assert len(calls) == 1
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "bool_2d"])
def test_key_padding_masks_become_seqlens_k(monkeypatch, mask_kind):
    q, k, v = (x.double() for x in _qkv(B=3, Nk=20))
    lengths = torch.tensor([20, 7, 1])
    visible = torch.arange(20)[None, :] < lengths[:, None]  # [B, Nk]
    if mask_kind == "bool":
        mask = visible[:, None, None, :]
    elif mask_kind == "additive":
        mask = torch.zeros(3, 1, 1, 20, dtype=torch.float64).masked_fill(~visible[:, None, None, :], float("-inf"))
    else:  # one mask for every batch, broadcast from [1, Nk]
        mask = visible[1:2].expand(1, 20)
    calls = _runs_attnzoo(monkeypatch)
    ours = attnzoo.sdpa(q, k, v, attn_mask=mask)
    assert len(calls) == 1 and calls[0]["seqlens_k"] is not None
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "shape, kwargs",
    [
        (dict(), dict(dropout_p=0.5)),  # dropout
        (dict(), dict(attn_mask="scattered")),  # a mask that is not key padding
        (dict(), dict(attn_mask="causal_bool")),  # a full [Nq, Nk] mask
    ],
)
def test_other_calls_go_to_torch(monkeypatch, shape, kwargs):
    q, k, v = (x.double() for x in _qkv(**shape))
    Nq, Nk = q.shape[2], k.shape[2]
    if kwargs.get("attn_mask") == "scattered":
        kwargs["attn_mask"] = torch.rand(1, Nk, generator=torch.Generator().manual_seed(2)) < 0.5
    elif kwargs.get("attn_mask") == "causal_bool":
        kwargs["attn_mask"] = torch.ones(Nq, Nk, dtype=torch.bool).tril()
    calls = _runs_attnzoo(monkeypatch)
    torch.manual_seed(3)
    ours = attnzoo.sdpa(q, k, v, **kwargs)
    torch.manual_seed(3)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert not calls
    torch.testing.assert_close(ours, theirs)


def test_torchs_errors_stay_torchs():
    q, k, v = _qkv(H=6, Hkv=2)
    with pytest.raises(RuntimeError):
        attnzoo.sdpa(q, k, v)  # grouped heads without enable_gqa: torch refuses


def test_patched_swaps_the_function_for_the_block_only(monkeypatch):
    original = F.scaled_dot_product_attention
    calls = _runs_attnzoo(monkeypatch)
    q, k, v = _qkv()
    with attnzoo.sdpa_patched(backend="torch_fa1"):
        assert F.scaled_dot_product_attention is attnzoo.sdpa
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention is original
    assert calls and calls[0]["backend"] == "torch_fa1"
    with pytest.raises(TypeError, match="backend"), attnzoo.sdpa_patched(backend=3):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_gpt_trains_as_with_torchs_sdpa(dtype):
    """Losses of 4 training steps and the first step's gradients of every parameter, under SPEC.md's rule: attnzoo's
    error against the float64 run at most twice that of torch's SDPA in the same dtype, plus one rounding unit."""
    exact_losses, exact_grads = train(torch.float64, "cpu")
    torch_losses, torch_grads = train(dtype, "cpu")
    with attnzoo.sdpa_patched():
        losses, grads = train(dtype, "cpu")
    if dtype == torch.float64:
        torch.testing.assert_close(losses, exact_losses, atol=1e-12, rtol=1e-12)
        return
    assert_within_rule("loss", losses, torch_losses, exact_losses, dtype)
    for name in exact_grads:
        assert_within_rule(name, grads[name], torch_grads[name], exact_grads[name], dtype)
