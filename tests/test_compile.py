"""SPEC.md, "Every public call works inside torch.compile(fullgraph=True) with no graph break": the custom operators
on the CPU (the GPU half, with the Triton backends, CUDA graphs and no host synchronisation, is in test_gpu_compile.py).
"""

from __future__ import annotations

import pytest
import torch

import attnzoo
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
