"""SPEC.md, "Bad input": every public call validates before any kernel starts, raises ValueError or TypeError
naming the argument, and modifies nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import attnzoo
from attnzoo.validation import validate_forward

B, H, HKV, NQ, NK, D = 2, 4, 2, 8, 6, 16


def good(dtype=torch.float32):
    q = torch.randn(B, H, NQ, D, dtype=dtype)
    k = torch.randn(B, HKV, NK, D, dtype=dtype)
    v = torch.randn(B, HKV, NK, D, dtype=dtype)
    return q, k, v


# (what is wrong, the error type, a word the message must contain, a function of (q, k, v) giving the call's kwargs)
FORWARD_CASES = [
    ("q of rank 3", ValueError, "q", lambda q, k, v: dict(q=q[0])),
    ("k of rank 5", ValueError, "k", lambda q, k, v: dict(k=k[None])),
    ("batch mismatch", ValueError, "batch", lambda q, k, v: dict(k=k[:1], v=v[:1])),
    ("head dim mismatch", ValueError, "head dim", lambda q, k, v: dict(k=k[..., :8], v=v[..., :8])),
    ("k and v lengths differ", ValueError, "k and v", lambda q, k, v: dict(v=v[:, :, :3])),
    (
        "H % Hkv != 0",
        ValueError,
        "multiple",
        lambda q, k, v: dict(k=k.repeat(1, 3, 1, 1)[:, :3], v=v[:, :1].repeat(1, 3, 1, 1)),
    ),
    ("different devices", ValueError, "device", lambda q, k, v: dict(k=k.to("meta"))),
    ("mixed dtypes", TypeError, "dtype", lambda q, k, v: dict(v=v.double())),
    ("integer dtype", TypeError, "dtype", lambda q, k, v: dict(q=q.to(torch.int32))),
    ("complex dtype", TypeError, "dtype", lambda q, k, v: dict(q=q.to(torch.complex64))),
    ("q is a list", TypeError, "q", lambda q, k, v: dict(q=q.tolist())),
    ("causal is a string", TypeError, "causal", lambda q, k, v: dict(causal="yes")),
    ("scale is a string", TypeError, "scale", lambda q, k, v: dict(scale="0.1")),
    ("scale is NaN", ValueError, "scale", lambda q, k, v: dict(scale=float("nan"))),
    ("seqlens_k of wrong shape", ValueError, "seqlens_k", lambda q, k, v: dict(seqlens_k=torch.tensor([1, 2, 3]))),
    ("seqlens_k of float dtype", TypeError, "seqlens_k", lambda q, k, v: dict(seqlens_k=torch.tensor([1.0, 2.0]))),
    ("seqlens_k above Nk", ValueError, "seqlens_k", lambda q, k, v: dict(seqlens_k=torch.tensor([1, NK + 1]))),
    ("seqlens_k negative", ValueError, "seqlens_k", lambda q, k, v: dict(seqlens_k=torch.tensor([-1, 2]))),
    ("seqlens_k a list", TypeError, "seqlens_k", lambda q, k, v: dict(seqlens_k=[1, 2])),
    ("seqlens_k of bool dtype", TypeError, "seqlens_k", lambda q, k, v: dict(seqlens_k=torch.tensor([True, True]))),
    (
        "seqlens_k on another device",
        ValueError,
        "seqlens_k",
        lambda q, k, v: dict(seqlens_k=torch.ones(2, dtype=torch.int32, device="meta")),
    ),
    ("sparse q", TypeError, "q", lambda q, k, v: dict(q=q.to_sparse())),
    ("scale beyond float", ValueError, "scale", lambda q, k, v: dict(scale=10**400)),
    ("scale beyond float32", ValueError, "scale", lambda q, k, v: dict(scale=1e39)),
    ("scale is a bool", TypeError, "scale", lambda q, k, v: dict(scale=True)),
    ("v of other K/V heads", ValueError, "k and v", lambda q, k, v: dict(v=v[:, :1])),
    ("v of no head dim", ValueError, "Dv", lambda q, k, v: dict(v=v[..., :0])),
    # SPEC.md, "Score modifiers": window a pair of ints or None; softcap >= 0 and finite; slopes float32 [H] or [B, H]
    ("window of three sides", TypeError, "window", lambda q, k, v: dict(window=(1, 2, 3))),
    ("window an int", TypeError, "window", lambda q, k, v: dict(window=4)),
    ("window of floats", TypeError, "window", lambda q, k, v: dict(window=(1.5, None))),
    ("window with a bool side", TypeError, "window", lambda q, k, v: dict(window=(True, 2))),
    ("window a string", TypeError, "window", lambda q, k, v: dict(window="3,2")),
    ("window of tensors", TypeError, "window", lambda q, k, v: dict(window=(torch.tensor(1), 2))),
    ("softcap negative", ValueError, "softcap", lambda q, k, v: dict(softcap=-1.0)),
    ("softcap inf", ValueError, "softcap", lambda q, k, v: dict(softcap=float("inf"))),
    ("softcap NaN", ValueError, "softcap", lambda q, k, v: dict(softcap=float("nan"))),
    ("softcap beyond float32", ValueError, "softcap", lambda q, k, v: dict(softcap=1e39)),
    ("softcap below float32's range", ValueError, "softcap", lambda q, k, v: dict(softcap=1e-45)),
    ("softcap a string", TypeError, "softcap", lambda q, k, v: dict(softcap="30")),
    ("softcap None", TypeError, "softcap", lambda q, k, v: dict(softcap=None)),
    ("alibi_slopes of H + 1", ValueError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=torch.rand(H + 1))),
    ("alibi_slopes [B, H, 1]", ValueError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=torch.rand(B, H, 1))),
    ("alibi_slopes [H, B]", ValueError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=torch.rand(H, B))),
    ("alibi_slopes float64", TypeError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=torch.rand(H).double())),
    ("alibi_slopes float16", TypeError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=torch.rand(H).half())),
    ("alibi_slopes a list", TypeError, "alibi_slopes", lambda q, k, v: dict(alibi_slopes=[0.5] * H)),
    (
        "alibi_slopes on another device",
        ValueError,
        "alibi_slopes",
        lambda q, k, v: dict(alibi_slopes=torch.ones(H, device="meta")),
    ),
]


def _call_forward(backend, **changes):
    q, k, v = good()
    args = dict(q=q, k=k, v=v, causal=False, scale=None, seqlens_k=None, window=None, softcap=0.0, alibi_slopes=None)
    args.update(changes)
    return backend.forward(**args)


@pytest.fixture
def no_kernel(monkeypatch):
    """Make any kernel launch fail the test: validation must come first."""

    def fail(*args, **kwargs):
        raise AssertionError("a kernel ran before validation")

    for name in attnzoo.names():
        monkeypatch.setattr(attnzoo.get(name), "_forward", fail)
        monkeypatch.setattr(attnzoo.get(name), "_backward", fail)


@pytest.mark.parametrize("name", attnzoo.names())
@pytest.mark.parametrize("what, error, word, change", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects(name, what, error, word, change, no_kernel):
    q, k, v = good()
    with pytest.raises(error, match=word):
        _call_forward(attnzoo.get(name), **change(q, k, v))


@pytest.mark.parametrize("name", attnzoo.names())
@pytest.mark.parametrize("what, error, word, change", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_attention_and_support_query_reject(name, what, error, word, change, no_kernel):
    q, k, v = good()
    args = dict(q=q, k=k, v=v, causal=False, scale=None, seqlens_k=None)
    args.update(change(q, k, v))
    with pytest.raises(error, match=word):
        attnzoo.attention(**args, backend=name)
    with pytest.raises(error, match=word):
        attnzoo.get(name).not_supported_reasons(**args)


BACKWARD_CASES = [
    ("do of wrong shape", ValueError, "do", lambda do, o, lse: dict(do=do[:, :, :3])),
    ("o of wrong dtype", TypeError, "o", lambda do, o, lse: dict(o=o.double())),
    ("lse of wrong shape", ValueError, "lse", lambda do, o, lse: dict(lse=lse[..., None])),
    ("lse of wrong dtype", TypeError, "lse", lambda do, o, lse: dict(lse=lse.double())),
    ("do on another device", ValueError, "do", lambda do, o, lse: dict(do=do.to("meta"))),
    ("lse on another device", ValueError, "lse", lambda do, o, lse: dict(lse=lse.to("meta"))),
    ("o of wrong shape", ValueError, "o", lambda do, o, lse: dict(o=o[:1])),
    ("lse a numpy array", TypeError, "lse", lambda do, o, lse: dict(lse=lse.numpy())),
    ("do with D where v has Dv", ValueError, "Dv", lambda do, o, lse: dict(do=torch.randn(B, H, NQ, D))),
]


@pytest.mark.parametrize("name", attnzoo.names())
@pytest.mark.parametrize("what, error, word, change", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_backward_rejects(name, what, error, word, change, no_kernel):
    q, k, _ = good()
    v = torch.randn(B, HKV, NK, D + 8)  # o and do take v's head dim
    do, o, lse = torch.randn(B, H, NQ, D + 8), torch.randn(B, H, NQ, D + 8), torch.randn(B, H, NQ)
    args = dict(do=do, o=o, lse=lse)
    args.update(change(do, o, lse))
    with pytest.raises(error, match=word):
        attnzoo.get(name).backward(args["do"], q, k, v, args["o"], args["lse"])


@pytest.mark.parametrize("name", attnzoo.names())
def test_head_dim_above_the_declared_limit_is_a_value_error(name, no_kernel):
    limit = attnzoo.get(name).capabilities.max_head_dim
    if limit is None:
        pytest.skip(f"{name} declares no head-dim limit")
    q = torch.randn(1, 1, 4, limit + 8)
    for call in (attnzoo.get(name).forward, attnzoo.get(name).not_supported_reasons):
        with pytest.raises(ValueError, match=f"D={limit + 8}"):
            call(q, q, q)
    with pytest.raises(ValueError, match=f"D={limit + 8}"):
        attnzoo.attention(q, q, q, backend=name)
    # v's own head dim is held to the same limit, also where the backend has no Dv != D yet
    q_ok, v_wide = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, limit + 8)
    for call in (attnzoo.get(name).forward, attnzoo.get(name).not_supported_reasons):
        with pytest.raises(ValueError, match=f"Dv={limit + 8}"):
            call(q_ok, q_ok, v_wide)


@pytest.mark.parametrize("name", attnzoo.names())
def test_bad_input_modifies_nothing(name):
    q, k, v = good()
    copies = [x.clone() for x in (q, k, v)]
    with pytest.raises(ValueError):
        attnzoo.get(name).forward(q, k, v, seqlens_k=torch.tensor([NK + 5, 0]))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies, strict=True))


def test_unsupported_case_is_not_implemented_with_the_reasons():
    q, k, v = good()
    meta = [x.to("meta") for x in (q, k, v)]
    reasons = attnzoo.get("torch_fa2").not_supported_reasons(*meta)
    assert reasons and "meta" in reasons[0]
    with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
        attnzoo.get("torch_fa2").forward(*meta)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        attnzoo.get("torch_fa2").forward(q.numpy(), k.numpy(), v.numpy())
    with pytest.raises(TypeError, match=r"torch\.Tensor or numpy\.ndarray"):
        attnzoo.get("numpy_ref").forward(q.tolist(), k, v)
    with pytest.raises(TypeError, match="must all be torch tensors or all numpy arrays"):
        attnzoo.get("numpy_ref").forward(q.numpy(), k, v)


def test_unknown_backend_lists_the_known_names():
    with pytest.raises(ValueError, match="torch_fa2") as info:
        attnzoo.get("flash9")
    assert all(name in str(info.value) for name in attnzoo.names())
    q, k, v = good()
    with pytest.raises(ValueError, match="unknown backend"):
        attnzoo.attention(q, k, v, backend="flash9")
    with pytest.raises(TypeError, match="backend"):
        attnzoo.attention(q, k, v, backend=3)


def test_numpy_inputs_are_checked_too():
    q, k, v = (x.numpy() for x in good())
    with pytest.raises(TypeError, match="dtype"):
        attnzoo.get("numpy_ref").forward(q.astype(np.int64), k, v)
    with pytest.raises(ValueError, match="rank"):
        attnzoo.get("numpy_ref").forward(q[0], k, v)


def test_unsigned_seqlens_k_are_accepted():
    q, k, v = good()
    lens = torch.tensor([NK, 2])
    o_ref, _ = attnzoo.get("torch_fa2").forward(q, k, v, seqlens_k=lens)
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        o, _ = attnzoo.get("torch_fa2").forward(q, k, v, seqlens_k=lens.to(dtype))
        assert torch.equal(o, o_ref)


def test_a_remembered_call_lets_no_equal_but_bad_argument_through():
    """A plain call validated once is remembered (the same Problem comes back without the checks); an argument equal
    to a remembered one but of another type (``1 == True``) is still checked and refused."""
    q, k, v = good()
    be = attnzoo.get("torch_fa2")
    remembered = validate_forward(q, k, v, True, 0.5, None, (1, 0), 1.0)
    assert validate_forward(q, k, v, True, 0.5, None, (1, 0), 1.0) is remembered
    with pytest.raises(TypeError, match="causal"):
        be.forward(q, k, v, causal=1, scale=0.5, window=(1, 0), softcap=1.0)
    with pytest.raises(TypeError, match="window"):
        be.forward(q, k, v, causal=True, scale=0.5, window=(True, 0), softcap=1.0)
    with pytest.raises(TypeError, match="softcap"):
        be.forward(q, k, v, causal=True, scale=0.5, window=(1, 0), softcap=True)
    validate_forward(q, k, v, True, 1.0, None, (1, 0), 1.0)
    with pytest.raises(TypeError, match="scale"):  # True == 1.0
        be.forward(q, k, v, causal=True, scale=True, window=(1, 0), softcap=1.0)
    with pytest.raises(ValueError, match="head dim"):  # other shapes are other calls
        be.forward(q, k[..., :8], v, causal=True, scale=0.5, window=(1, 0), softcap=1.0)
