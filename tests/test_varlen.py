"""SPEC.md, "Packed variable-length batches": ``attnzoo.attention_varlen`` on every backend against the float64 oracle
run on each sequence alone; sequences that never see each other; bad input refused before any kernel; the custom
operators under ``opcheck`` and ``torch.compile``.

The GPU half (the compiled Triton kernels, long sequences, bfloat16) is in test_gpu_varlen.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from cases import BF16, F16, F32, F64
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo.backend import triton_interpreter_active
from attnzoo.testing_varlen import (
    VARLEN_LAYOUTS,
    check_varlen_backend,
    cu_seqlens,
    random_varlen_inputs,
    run_varlen_backend,
    varlen_oracle_for,
)
from attnzoo.varlen import attention_varlen_backward_op, attention_varlen_forward_op

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class VarlenCase:
    """One packed call: the lengths of each sequence, heads, head dims, masks, score modifiers, dtype, layout."""

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float
    alibi: str
    dtype: torch.dtype
    layout: str
    scale: float | None
    seed: int

    def make(self, device: str = DEVICE):
        return random_varlen_inputs(
            self.lengths_q, self.lengths_k, self.heads, self.kv_heads, self.head_dim, dtype=self.dtype,
            device=device, seed=self.seed, head_dim_v=self.head_dim_v, alibi=self.alibi, layout=self.layout,
        )  # fmt: skip

    @property
    def modifiers(self) -> dict:
        return dict(window=self.window, softcap=self.softcap)


def _length(max_len: int) -> st.SearchStrategy[int]:
    """A sequence length: empty, one, around a tile edge, or any up to ``max_len`` (mostly short: CI's time)."""
    edges = [n for n in (0, 0, 1, 2, 15, 16, 17, 33, 64, 65, 129, 300) if n <= max_len]
    return st.one_of(st.sampled_from(edges), st.integers(0, min(max_len, 40)), st.integers(0, max_len))


@st.composite
def varlen_cases(draw, dtypes, max_len: int, max_batch: int = 9, max_head_dim: int = 64) -> VarlenCase:
    """Batches of 0 to ``max_batch`` sequences of 0 to ``max_len`` rows, Nq != Nk per sequence about half the time,
    grouped-query heads, causal, windows (one-sided, negative, wider than a sequence), soft caps, ALiBi, Dv != D."""
    batch = draw(st.integers(0, max_batch))
    lengths_q = tuple(draw(_length(max_len)) for _ in range(batch))
    if draw(st.booleans()):
        lengths_k = lengths_q
    else:
        lengths_k = tuple(draw(_length(max_len)) for _ in range(batch))
    kv_heads = draw(st.integers(1, 2))
    head_dims = st.one_of(st.sampled_from([d for d in (8, 16, 24, 32, 40, 64) if d <= max_head_dim]))
    head_dim = draw(head_dims)
    window = None
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.sampled_from([0, 1, -1, 5, 2**40]), st.integers(-20, max_len + 5))
        window = (draw(side), draw(side))
    dtype = draw(st.sampled_from(dtypes))
    softcap = 0.0
    if draw(st.booleans()):
        softcap = draw(st.sampled_from([0.05, 1.0, 5.0, 30.0] if dtype == F32 else [1e-3, 1.0, 5.0, 30.0]))
    return VarlenCase(
        lengths_q=lengths_q,
        lengths_k=lengths_k,
        heads=kv_heads * draw(st.sampled_from([1, 2, 3])),
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=draw(st.one_of(st.just(head_dim), head_dims)),
        causal=draw(st.booleans()),
        window=window,
        softcap=softcap,
        alibi=draw(st.sampled_from(["none", "heads", "batch-heads"])),
        dtype=dtype,
        layout=draw(st.sampled_from(VARLEN_LAYOUTS)),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.5), st.floats(-1.0, -0.05))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _interpreted(name: str) -> bool:
    return DEVICE == "cpu" and name.startswith("triton") and triton_interpreter_active()


def _runnable_dtypes(backend: attnzoo.Backend) -> tuple[torch.dtype, ...]:
    """The declared dtypes the backend runs here (the Triton interpreter refuses bfloat16)."""
    one = torch.ones(1, 1, 16, device=DEVICE)
    offsets = cu_seqlens([1], DEVICE)
    runnable = []
    for dtype in sorted(backend.capabilities.dtypes, key=str):
        x = one.to(dtype)
        problem = attnzoo.varlen.validate_varlen(x, x, x, offsets, offsets)
        if not backend.reasons_for(problem):
            runnable.append(dtype)
    return tuple(runnable)


def _check(backend: attnzoo.Backend, case: VarlenCase) -> None:
    x = case.make()
    before = {name: t.clone() for name, t in vars(x).items() if isinstance(t, torch.Tensor)}
    outputs, checks = check_varlen_backend(backend, x, case.causal, case.scale, **case.modifiers)
    for name, t in before.items():
        assert torch.equal(getattr(x, name), t), f"input {name} was modified"
    total_q, total_k = sum(case.lengths_q), sum(case.lengths_k)
    assert outputs["o"].shape == (total_q, case.heads, case.head_dim_v) and outputs["o"].dtype == case.dtype
    assert outputs["lse"].shape == (case.heads, total_q)
    assert outputs["dk"].shape == (total_k, case.kv_heads, case.head_dim) and outputs["dk"].dtype == case.dtype
    for name, check in checks.items():
        assert check.ok, f"{name}: {check.message} ({case})"


def _draw_and_check(name: str, data) -> None:
    backend = attnzoo.get(name)
    dtypes = _runnable_dtypes(backend)
    if not dtypes:
        pytest.skip(f"{name} runs no dtype on {DEVICE}")
    # The Triton interpreter runs every program in Python: short sequences, few of them.
    limits = dict(max_len=40, max_batch=4, max_head_dim=16) if _interpreted(name) else dict(max_len=300)
    _check(backend, data.draw(varlen_cases(dtypes, **limits), label="case"))


# Example counts bounded for CI's 2-core machine (each example runs the oracle on up to 9 sequences); the GPU run
# (test_gpu_varlen.py) draws more and longer ones.
@pytest.mark.parametrize("name", [n for n in attnzoo.names() if not n.startswith("triton")])
@given(data=st.data())
@settings(max_examples=15)
def test_matches_oracle_per_sequence(name, data):
    _draw_and_check(name, data)


@pytest.mark.parametrize("name", [n for n in attnzoo.names() if n.startswith("triton")])
@given(data=st.data())
@settings(max_examples=6)
def test_triton_matches_oracle_per_sequence(name, data):
    _draw_and_check(name, data)


EDGE_CASES = {
    # the lengths of `compare --varlen`'s example, keys longer and shorter than queries, causal with Nq > Nk
    "mixed": VarlenCase(
        (40, 0, 17, 1, 33), (40, 5, 9, 0, 50), 4, 2, 16, 16, True, None, 0.0, "none", F32, "contiguous", None, 1
    ),
    # every sequence empty but one key-only sequence (keys that no row reads get zero gradients)
    "keys-only": VarlenCase((0, 0), (0, 23), 2, 1, 16, 16, False, None, 0.0, "none", F32, "padded", None, 2),
    # a window narrower than a tile, ALiBi per sequence, Dv != D, a soft cap, a negative scale
    "modifiers": VarlenCase(
        (20, 3, 29), (20, 40, 7), 3, 1, 24, 8, True, (6, None), 5.0, "batch-heads", F32, "heads-major", -0.4, 3
    ),
    # a band ahead of the diagonal only: the last rows of each sequence see no key
    "window-ahead": VarlenCase(
        (20, 18), (20, 18), 2, 2, 16, 16, False, (-2, None), 0.0, "heads", F32, "contiguous", None, 4
    ),
}


@pytest.mark.parametrize("edge", list(EDGE_CASES))
@pytest.mark.parametrize("name", attnzoo.names())
def test_edge_cases(name, edge):
    backend = attnzoo.get(name)
    for dtype in _runnable_dtypes(backend):
        case = EDGE_CASES[edge]
        _check(backend, VarlenCase(**{**vars(case), "dtype": dtype}))


@pytest.mark.parametrize("name", attnzoo.names())
def test_rows_never_see_keys_of_another_sequence(name):
    """NaN in the keys and values of sequence 1 reaches its own rows only: every other sequence's outputs and
    gradients are finite and bitwise those of the batch without the NaN."""
    backend = attnzoo.get(name)
    dtype = _runnable_dtypes(backend)[0] if _runnable_dtypes(backend) else pytest.skip("no dtype here")
    x = random_varlen_inputs((19, 21, 17), (23, 21, 30), 2, 1, 16, dtype=dtype, device=DEVICE, seed=5)
    clean = run_varlen_backend(backend, x, causal=True)
    rows_q, rows_k = x.rows(1)
    k, v = x.k.clone(), x.v.clone()
    k[rows_k], v[rows_k] = float("nan"), float("nan")
    poisoned = run_varlen_backend(backend, type(x)(**{**vars(x), "k": k, "v": v}), causal=True)
    for name_, rows in (("o", rows_q), ("dq", rows_q), ("dk", rows_k), ("dv", rows_k)):
        outside = torch.ones(clean[name_].shape[0], dtype=torch.bool, device=DEVICE)
        outside[rows] = False
        assert torch.isfinite(poisoned[name_][outside]).all(), f"{name_}: NaN outside sequence 1"
        assert torch.equal(poisoned[name_][outside], clean[name_][outside]), f"{name_} of another sequence changed"
        assert torch.isnan(poisoned[name_][rows]).any(), f"{name_}: the NaN of sequence 1 was hidden"
    outside_rows = torch.cat([torch.arange(0, rows_q.start), torch.arange(rows_q.stop, clean["lse"].shape[1])])
    assert torch.equal(poisoned["lse"][:, outside_rows], clean["lse"][:, outside_rows])


def test_attention_varlen_autograd_and_lse_match_the_oracle():
    """The public call: o and (with return_lse) lse, gradients by autograd, the hints given or not."""
    x = random_varlen_inputs((30, 0, 12, 7), (25, 6, 12, 40), 4, 2, 16, dtype=F64, seed=6, alibi="heads")
    judge = varlen_oracle_for(x, True, 0.3, window=(8, None))
    for hints in (dict(), dict(max_seqlen_q=30, max_seqlen_k=40), dict(max_seqlen_q=100, max_seqlen_k=41)):
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        o, lse = attnzoo.attention_varlen(
            q, k, v, x.cu_seqlens_q, x.cu_seqlens_k, causal=True, scale=0.3, window=(8, None),
            alibi_slopes=x.alibi_slopes, return_lse=True, **hints,
        )  # fmt: skip
        assert not lse.requires_grad
        o.backward(x.do)
        checks = judge.check(dict(o=o.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad))
        assert all(c.ok for c in checks.values()), {n: c.message for n, c in checks.items()}
    o_only = attnzoo.attention_varlen(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, causal=True, scale=0.3,
                                      window=(8, None), alibi_slopes=x.alibi_slopes)  # fmt: skip
    assert isinstance(o_only, torch.Tensor) and torch.equal(o_only, o.detach())


@pytest.mark.parametrize("batch", [0, 3])
def test_no_query_rows_gives_empty_outputs_and_zero_key_gradients(batch):
    lengths_k = (0, 5, 0)[:batch]
    x = random_varlen_inputs((0,) * batch, lengths_k, 2, 2, 8, dtype=F32, seed=7)
    k = x.k.detach().clone().requires_grad_()
    q = x.q.detach().clone().requires_grad_()
    o, lse = attnzoo.attention_varlen(q, k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, return_lse=True)
    assert o.shape == (0, 2, 8) and lse.shape == (2, 0)
    o.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def _bad_inputs():
    x = random_varlen_inputs((5, 3), (4, 6), 2, 1, 8, dtype=F32, seed=8)
    return x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


BAD_INPUTS = {
    "cu_seqlens_q int64": (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "cu_seqlens_q.*int32"),
    "cu_seqlens_k float": (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"].float()}, TypeError, "cu_seqlens_k"),
    "cu_seqlens_q a list": (lambda a: {**a, "cu_seqlens_q": [0, 5, 8]}, TypeError, "cu_seqlens_q"),
    "cu_seqlens_q 2-d": (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, "cu_seqlens_q.*1-d"),
    "cu_seqlens_q empty": (lambda a: {**a, "cu_seqlens_q": _i32([])}, ValueError, "cu_seqlens_q.*1-d"),
    "not starting at 0": (lambda a: {**a, "cu_seqlens_q": _i32([1, 5, 8])}, ValueError, "cu_seqlens_q must start at 0"),
    "decreasing": (lambda a: {**a, "cu_seqlens_k": _i32([0, 7, 6])}, ValueError, "cu_seqlens_k must be non-decreasing"),
    "not ending at total": (lambda a: {**a, "cu_seqlens_q": _i32([0, 5, 7])}, ValueError, "end at total_q .* = 8"),
    "B mismatch": (lambda a: {**a, "cu_seqlens_k": _i32([0, 10])}, ValueError, "same batch"),
    "hint below a length": (lambda a: {**a, "max_seqlen_k": 5}, ValueError, "max_seqlen_k = 5 is below .* 6"),
    "hint not an int": (lambda a: {**a, "max_seqlen_q": 5.0}, TypeError, "max_seqlen_q"),
    "q of rank 4": (lambda a: {**a, "q": a["q"][None]}, ValueError, "q must have rank 3"),
    "k and v rows differ": (lambda a: {**a, "v": a["v"][:-1]}, ValueError, "k and v"),
    "H not a multiple": (
        lambda a: {**a, "k": torch.randn(10, 3, 8), "v": torch.randn(10, 3, 8)},
        ValueError,
        "multiple",
    ),
    "slopes of another batch": (lambda a: {**a, "alibi_slopes": torch.rand(3, 2)}, ValueError, r"\[B, H\] = \[2, 2\]"),
    "integer q": (lambda a: {**a, "q": a["q"].int()}, TypeError, "q must have a floating dtype"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_input_is_refused_before_any_kernel(bad, monkeypatch):
    q, k, v, cu_q, cu_k = _bad_inputs()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    edit, error, message = BAD_INPUTS[bad]
    args = edit(args)

    def no_kernel(*_, **__):
        raise AssertionError("a kernel ran on bad input")

    monkeypatch.setattr(attnzoo.varlen, "run_varlen_forward", no_kernel)
    with pytest.raises(error, match=message):
        attnzoo.attention_varlen(**args)


@pytest.mark.skipif(DEVICE != "cpu" or not torch.cuda.is_available(), reason="needs a CPU and a CUDA device")
def test_cu_seqlens_on_another_device_is_refused():
    q, k, v, cu_q, cu_k = _bad_inputs()
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the device of q"):
        attnzoo.attention_varlen(q, k, v, cu_q.cuda(), cu_k)


def test_cu_seqlens_on_the_meta_device_is_refused():
    q, k, v, cu_q, cu_k = _bad_inputs()
    with pytest.raises(ValueError, match="cu_seqlens_k must be on the device of q"):
        attnzoo.attention_varlen(q, k, v, cu_q, cu_k.to("meta"))


def _attend(q, k, v, cu_q, cu_k):
    o = attnzoo.attention_varlen(q * 1.5, k, v, cu_q, cu_k, 30, 40, causal=True, backend="torch_fa2")
    return o.sin()


def test_attention_varlen_is_one_graph_without_breaks_and_matches_eager():
    x = random_varlen_inputs((30, 0, 12), (25, 6, 40), 4, 2, 16, dtype=F32, seed=9)
    args = (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k)
    explained = torch._dynamo.explain(_attend)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, _attend):
        leaves = [t.detach().clone().requires_grad_() for t in args[:3]]
        out = fn(*leaves, *args[3:])
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("with_modifiers", [False, True])
def test_operators_pass_opcheck(with_modifiers):
    x = random_varlen_inputs((30, 0, 12), (25, 6, 40), 4, 2, 16, dtype=F32, seed=10, alibi="batch-heads")
    modifiers = (9, 2, 5.0, x.alibi_slopes) if with_modifiers else (None, None, 0.0, None)
    arguments = (x.cu_seqlens_q, x.cu_seqlens_k, 30, 40, True, 0.3, *modifiers, "torch_fa2")
    leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.v)]
    torch.library.opcheck(attention_varlen_forward_op, (*leaves, *arguments))
    o, lse = attention_varlen_forward_op(x.q, x.k, x.v, *arguments)
    torch.library.opcheck(attention_varlen_backward_op, (torch.randn_like(o), x.q, x.k, x.v, o, lse, *arguments))


def test_every_dtype_runs_on_some_backend_here():
    """float64 through the references; float32 and float16 everywhere on the CPU; bfloat16 on the references."""
    for dtype in (F64, F32, F16, BF16):
        x = random_varlen_inputs((9, 4), (9, 11), 2, 1, 8, dtype=dtype, seed=11)
        o = attnzoo.attention_varlen(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, causal=True)
        assert o.dtype == dtype and not math.isnan(float(o.float().sum()))


def test_compare_runs_every_backend_on_a_packed_case(capsys):
    from attnzoo import compare

    argv = ["--varlen", "20,0,7", "--varlen-k", "20,3,9", "--causal", "--H", "2", "--Hkv", "1", "--D", "8"]
    assert compare.main([*argv, "--repeat", "1", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    for name in attnzoo.names():
        assert name in table
    assert "OUT OF TOLERANCE" not in table and "ERROR" not in table


@pytest.mark.parametrize(
    "argv", [["--varlen", "3,-1"], ["--varlen", "3,x"], ["--varlen-k", "3"], ["--varlen", "3", "--Nq", "4"],
             ["--varlen", "3,4", "--varlen-k", "3"]],
)  # fmt: skip
def test_compare_refuses_bad_varlen_flags(argv):
    from attnzoo import compare

    with pytest.raises(SystemExit) as exit_:
        compare.main(argv)
    assert exit_.value.code == 2


def test_the_gluon_launchers_see_a_packed_tensor_as_one_batch_of_all_its_rows():
    """``gluon_hopper.packed_views``: a packed ``[total, H, D]`` tensor is seen as ``[1, H, total, D]`` (the same
    memory: a head's rows of the whole tensor, one TMA box per tile), a non-contiguous output of a packed call is
    refused by name (its masked stores step rows by ``H * D``), and a dense call's tensors pass as they are;
    ``grid_slots``: ``ceil(N / block)`` blocks a dense head, ``total // block + B`` slots a packed one."""
    from attnzoo.kernels.gluon_hopper import grid_slots, packed_views

    q, dq = torch.randn(300, 4, 64), torch.randn(300, 4, 64)
    varlen = (torch.tensor([0, 100, 300], dtype=torch.int32), torch.tensor([0, 90, 300], dtype=torch.int32), 2, 2)
    q_view, dq_view, sequences = packed_views((q, dq), {"dq": dq}, varlen, q)
    assert q_view.shape == dq_view.shape == (1, 4, 300, 64) and q_view.data_ptr() == q.data_ptr()
    assert sequences is varlen
    assert torch.equal(q_view[0, 2, 17], q[17, 2])
    with pytest.raises(ValueError, match="dq must be a contiguous"):
        packed_views((q, dq), {"dq": dq.transpose(0, 1).contiguous().transpose(0, 1)}, varlen, q)
    dense = torch.randn(2, 4, 300, 64)
    assert packed_views((dense,), {"o": dense}, None, q)[0] is dense
    assert grid_slots(300, 64, None) == 5 and grid_slots(300, 64, varlen) == 300 // 64 + 2
