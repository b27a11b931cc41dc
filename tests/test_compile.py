"""SPEC.md, "Every public call works inside torch.compile(fullgraph=True) with no graph break": the custom operators
on the CPU (the GPU half, with the Triton backends, CUDA graphs and no host synchronisation, is in test_gpu_compile.py),
and the autograd Function that plain eager calls take instead of them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnzoo
from attnzoo import autograd as autograd_module
from attnzoo.autograd import attention_backward_op, attention_forward_op


def _inputs(B=2, H=4, Hkv=2, Nq=33, Nk=40, D=16, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=gen)
    k, v = (torch.randn(B, Hkv, Nk, D, generator=gen) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _attend(q, k, v, seqlens_k):
    # A little arithmetic around the call, so that the graph holds more than the operator.
    return attnzoo.attention(q * 1.5, k, v, causal=True, seqlens_k=seqlens_k, backend="torch_fa2").sin()


def _value_and_grads(fn, q, k, v, seqlens_k):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, seqlens_k)
    out.square().sum().backward()
    return [out.detach(), *(x.grad for x in leaves)]


def test_attention_is_one_graph_without_breaks():
    q, k, v = _inputs()
    lens = torch.tensor([40, 17], dtype=torch.int32)
    explained = torch._dynamo.explain(_attend)(q, k, v, lens)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_attention_matches_eager_with_gradients(compiler):
    q, k, v = _inputs(seed=1)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True, backend=compiler)
    got = _value_and_grads(compiled, q, k, v, lens)
    expected = _value_and_grads(_attend, q, k, v, lens)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6, msg=name)


def test_dynamic_sequence_length_compiles_once():
    torch._dynamo.reset()
    frames = []

    def count_frames(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(_attend, fullgraph=True, backend=count_frames, dynamic=True)
    for n in (17, 40, 65, 130):
        q, k, v = _inputs(Nq=n, Nk=n + 3, seed=n)
        lens = torch.tensor([n + 3, n // 2], dtype=torch.int32)
        got = compiled(q, k, v, lens)
        torch.testing.assert_close(got, _attend(q, k, v, lens), atol=2e-6, rtol=2e-6)
    assert len(frames) == 1, f"compiled {len(frames)} times for 4 lengths"


def test_bad_input_still_raises_under_compile():
    q, k, v = _inputs(Hkv=3, H=4, requires_grad=False)
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="multiple of the number of K/V heads"):
        compiled(q, k, v, None)


@pytest.mark.parametrize("seqlens, with_modifiers", [(None, False), ((40, 3), False), ((40, 3), True)])
def test_operators_pass_opcheck(seqlens, with_modifiers):
    q, k, v = _inputs(requires_grad=False, seed=4)
    lens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    # (window_left, window_right, softcap, alibi_slopes)
    modifiers = (9, 2, 5.0, torch.rand(4) * 0.5) if with_modifiers else (None, None, 0.0, None)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attention_forward_op, (*leaves, lens, True, 0.3, *modifiers, "torch_fa2"))
    o, lse = attention_forward_op(q, k, v, lens, True, 0.3, *modifiers, "torch_fa2")
    do = torch.randn_like(o)
    torch.library.opcheck(attention_backward_op, (do, q, k, v, o, lse, lens, True, 0.3, *modifiers, "torch_fa2"))


def test_a_backend_instance_with_options_runs_through_the_operator():
    q, k, v = _inputs(seed=5)
    small_tiles = type(attnzoo.get("torch_fa2"))(block_m=16, block_n=8)
    got = _value_and_grads(
        lambda a, b, c, s: attnzoo.attention(a, b, c, causal=True, backend=small_tiles), q, k, v, None
    )
    expected = _value_and_grads(lambda a, b, c, s: attnzoo.attention(a, b, c, causal=True), q, k, v, None)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: calls under it must take the operators."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_modifiers", [False, True], ids=["plain", "modifiers"])
def test_plain_eager_calls_skip_the_operators_and_agree_with_them(monkeypatch, with_modifiers):
    """Plain eager calls take ``_EagerAttention``, not the operators; under a function mode the operators serve, with
    bitwise the same outputs and gradients."""
    operator_calls = []
    real_operator = autograd_module.attention_forward_op
    monkeypatch.setattr(
        autograd_module, "attention_forward_op", lambda *args: operator_calls.append(1) or real_operator(*args)
    )
    modifiers = (
        dict(window=(9, 0), softcap=2.5, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 1.0])) if with_modifiers else {}
    )

    def attend(q, k, v, seqlens_k):
        return attnzoo.attention(q, k, v, causal=True, seqlens_k=seqlens_k, backend="torch_fa2", **modifiers)

    q, k, v = _inputs(seed=7)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    eager = _value_and_grads(attend, q, k, v, lens)
    assert not operator_calls
    with _PassThrough():
        through_operators = _value_and_grads(attend, q, k, v, lens)
    assert operator_calls
    for a, b in zip(eager, through_operators, strict=True):
        assert torch.equal(a, b)


def _count_paths(monkeypatch) -> dict[str, int]:
    """Counts of the calls that take the autograd Function and the forward operator."""
    counts = {"function": 0, "operator": 0}
    real_apply, real_operator = autograd_module._EagerAttention.apply, autograd_module.attention_forward_op

    def apply(*args):
        counts["function"] += 1
        return real_apply(*args)

    def operator(*args):
        counts["operator"] += 1
        return real_operator(*args)

    monkeypatch.setattr(autograd_module._EagerAttention, "apply", apply)
    monkeypatch.setattr(autograd_module, "attention_forward_op", operator)
    return counts


def test_calls_without_gradients_call_the_backend_directly(monkeypatch):
    q, k, v = _inputs(seed=9)
    counts = _count_paths(monkeypatch)
    o = attnzoo.attention(q.detach(), k.detach(), v.detach(), causal=True, backend="torch_fa2")
    with torch.no_grad():
        o_no_grad = attnzoo.attention(q, k, v, causal=True, backend="torch_fa2")
    assert counts == {"function": 0, "operator": 0}
    o_graph = attnzoo.attention(q, k, v, causal=True, backend="torch_fa2")
    assert counts == {"function": 1, "operator": 0}
    assert o.grad_fn is None and o_no_grad.grad_fn is None and o_graph.grad_fn is not None
    assert torch.equal(o, o_no_grad) and torch.equal(o, o_graph.detach())


def test_alibi_slopes_alone_requiring_grad_get_none_on_both_paths(monkeypatch):
    q, k, v = _inputs(seed=10, requires_grad=False)
    for mode in (contextlib.nullcontext(), _PassThrough()):
        slopes = torch.tensor([0.5, 0.25, 0.125, 1.0], requires_grad=True)
        with mode:
            o = attnzoo.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="torch_fa2")
        o.sum().backward()
        assert slopes.grad is None


def test_a_second_derivative_fails_on_both_paths():
    """The backward has no derivative of its own: asking for one raises rather than dropping the term."""
    for mode in (contextlib.nullcontext(), _PassThrough()):
        q, k, v = _inputs(seed=11)
        with mode:
            o = attnzoo.attention(q, k, v, causal=True, backend="torch_fa2")
            (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
            assert dq.requires_grad  # dq is part of the graph; its derivative is what is missing
            with pytest.raises(RuntimeError, match="autograd"):
                dq.sum().backward()


def test_traced_and_transformed_calls_take_the_operator(monkeypatch):
    q, k, v = _inputs(seed=12, requires_grad=False)
    traced = torch.jit.trace(lambda a, b, c: attnzoo.attention(a, b, c, backend="torch_fa2"), (q, k, v))
    assert "attnzoo::attention_forward" in str(traced.graph)
    counts = _count_paths(monkeypatch)
    q_grad = q.clone().requires_grad_()
    scale = torch.tensor(2.0)
    torch.func.grad(lambda x: attnzoo.attention(q_grad, k, v, backend="torch_fa2").sum() * x)(scale)
    assert counts == {"function": 0, "operator": 1}


def test_fake_tensors_modes_and_functorch_transforms_take_the_operators():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _inputs(requires_grad=False)
    assert autograd_module._plain_eager(q, k, v, None, None)
    assert not autograd_module._plain_eager(q, k, torch.nn.Parameter(v), None, None)
    with _PassThrough():
        assert not autograd_module._plain_eager(q, k, v, None, None)
    with FakeTensorMode() as mode:
        assert not autograd_module._plain_eager(q, k, v, None, None)
        fake_o = attnzoo.attention(*(mode.from_tensor(x) for x in (q, k, v)), causal=True, backend="torch_fa2")
    assert fake_o.shape == q.shape

    def inside_grad(x):
        assert not autograd_module._plain_eager(x, k, v, None, None)
        return x.sum()

    torch.func.grad(inside_grad)(q)


def test_seqlens_modified_in_place_before_the_backward_fail_autograds_version_check():
    q, k, v = _inputs(seed=8)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    out = attnzoo.attention(q, k, v, causal=True, seqlens_k=lens, backend="torch_fa2")
    lens.add_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
