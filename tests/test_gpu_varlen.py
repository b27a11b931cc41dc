"""SPEC.md's packed variable-length batches on a CUDA GPU: the compiled Triton kernels (and torch_fa2 on CUDA) against
the float64 oracle per sequence, longer sequences than CI's, every dtype (bfloat16 included); the Gluon forward and
dK/dV kernels pinned, config by config; sequences isolated;
``torch.compile(fullgraph=True)`` with no host synchronisation when the hints are given; CUDA graph capture; opcheck.
Run with ``pytest -m gpu``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_varlen import VarlenCase, _check, varlen_cases

import attnzoo
from attnzoo.kernels.gluon_hopper import gluon_unavailable_reason
from attnzoo.kernels.launch import KernelVariant, prepare
from attnzoo.kernels.tuning import CANDIDATES, WIDE_GLUON_TILE, KernelConfig, candidates, head_dim_tile
from attnzoo.testing_varlen import VarlenInputs, random_varlen_inputs, run_varlen_backend, varlen_oracle_for
from attnzoo.varlen import attention_varlen_backward_op, attention_varlen_forward_op, validate_varlen

pytestmark = pytest.mark.gpu

TRITON = ("triton_2kernel", "triton_atomic")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("name", [*TRITON, "torch_fa2"])
@given(data=st.data())
@settings(max_examples=20)
def test_matches_oracle_per_sequence(name, data):
    case = data.draw(varlen_cases((F16, BF16, F32), max_len=700, max_batch=9, max_head_dim=128), label="case")
    _check(attnzoo.get(name), case)


# The benchmark's kind of batch: long sequences of mixed lengths, with empty and one-row ones between them.
LONG = {
    "bf16-causal-d128": VarlenCase(
        (1705, 0, 1, 2049, 777), (1705, 3, 1, 2049, 800), 4, 2, 128, 128, True, None, 0.0, "none", BF16, "contiguous",
        None, 1,
    ),
    "fp16-full-d64-window": VarlenCase(
        (1300, 129, 64), (1000, 129, 2000), 4, 4, 64, 64, False, (300, 17), 0.0, "heads", F16, "heads-major", None, 2
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LONG))
@pytest.mark.parametrize("name", TRITON)
def test_long_sequences(name, case):
    _check(attnzoo.get(name), LONG[case])


# The Gluon forward's own configs, pinned (persistent ones run their Triton twin on packed batches).
GLUON_FORWARD = [c for c in CANDIDATES["forward"] if c.gluon and not c.persistent]
GLUON_DKDV = [c for c in CANDIDATES["dkdv"] if c.gluon]
GLUON_DQ = [c for c in CANDIDATES["dq"] if c.gluon]
# (backend, pinned configs): the Triton kernels as tuned, then each Gluon config of the forward, dK/dV and dQ.
PINNED = (
    [(name, None) for name in TRITON]
    + [("triton_2kernel", {"forward": cfg}) for cfg in GLUON_FORWARD]
    + [("triton_2kernel", {"dkdv": cfg}) for cfg in GLUON_DKDV]
    + [("triton_2kernel", {"dq": cfg}) for cfg in GLUON_DQ]
)
VARIANTS = {"forward": KernelVariant.FORWARD, "dkdv": KernelVariant.DKDV, "dq": KernelVariant.DQ}


def _pinned_id(value) -> str:
    if value is None or isinstance(value, str):
        return "tuned" if value is None else value
    return "-".join(f"{kernel}={cfg}" for kernel, cfg in value.items())


def _gluon_reasons(x: VarlenInputs, variant: KernelVariant, causal: bool, window=None, softcap: float = 0.0) -> list:
    """Why the launch layer would run ``variant``'s Triton kernel instead of its Gluon one on the packed inputs ``x``
    (empty: the Gluon kernel runs).  A call out of scope would pass these tests on the Triton twin."""
    problem = validate_varlen(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, None, None, causal, None, window, softcap, x.alibi_slopes
    )
    call = prepare(x.q, x.k, x.v, problem)
    extra = {KernelVariant.DKDV: (x.do,), KernelVariant.DQ: (x.do, torch.empty_like(x.do))}.get(variant, ())
    return call.gluon_reasons(variant, *extra)  # the dQ kernel's o: a stand-in of its shape


# What is poisoned with NaN in sequence 1, the head dims (D, Dv) and the mask: the Gluon kernels zero the rows of a
# TMA box past a sequence's end (V in the forward; Q and dO in dK/dV; K and V in dQ) with a layout that depends on the
# tile's width.
POISONS = {
    "kv-d64-full": (("k", "v"), (64, 64), False),
    "qdokv-d64-full": (("q", "do", "k", "v"), (64, 64), False),
    "qdokv-d128-causal": (("q", "do", "k", "v"), (128, 128), True),
    # the head-dim-split backward kernels (backward_gluon_wide.py): zeroed rows in the three tiles of a ring slot, of
    # 128 and 64 columns, and of 256 (as the D = 256 forward's V tile)
    "wide-qdokv-d192-dv128-causal": (("q", "do", "k", "v"), (192, 128), True),
    "wide-qdokv-d256-causal": (("q", "do", "k", "v"), (256, 256), True),
}


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize(("name", "configs"), PINNED, ids=_pinned_id)
def test_rows_never_see_another_sequence(name, configs, poison):
    """A NaN in sequence 1's K and V (and its Q and dO) reaches no row of another sequence.  For the Gluon kernels
    this is the check of their zeroed rows: a TMA box of a sequence's last tile reads the next sequence's rows,
    where P = 0, and 0 * NaN would be NaN (V for the forward; Q and dO for dK/dV)."""
    if configs is not None and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    fields, (head_dim, head_dim_v), causal = POISONS[poison]
    dims = (head_dim, head_dim_v)
    for kernel, cfg in (configs or {}).items():
        if cfg not in candidates(kernel, head_dim_tile(head_dim), F16, torch.device("cuda"), gluon_head_dims=dims):
            pytest.skip(f"{cfg} is not a candidate at D={head_dim} Dv={head_dim_v} (the tuner drops it)")
    backend = attnzoo.get(name) if configs is None else attnzoo.get(name, configs=configs)
    x = random_varlen_inputs(
        (190, 300, 77), (230, 300, 64), 4, 2, head_dim, dtype=F16, device="cuda", seed=5, head_dim_v=head_dim_v
    )  # fmt: skip
    for kernel in configs or ():
        variant = VARIANTS[kernel]
        assert not _gluon_reasons(x, variant, causal), _gluon_reasons(x, variant, causal)
    clean = run_varlen_backend(backend, x, causal=causal)
    rows_q, rows_k = x.rows(1)
    changed = {}
    for field in fields:
        changed[field] = getattr(x, field).clone()
        changed[field][rows_q if field in ("q", "do") else rows_k] = float("nan")
    poisoned = run_varlen_backend(backend, type(x)(**{**vars(x), **changed}), causal=causal)
    for out, rows in (("o", rows_q), ("dq", rows_q), ("dk", rows_k), ("dv", rows_k)):
        outside = torch.ones(clean[out].shape[0], dtype=torch.bool, device="cuda")
        outside[rows] = False
        assert torch.isfinite(poisoned[out][outside]).all(), f"{out}: NaN outside sequence 1"
        if name == "triton_2kernel" or out in ("o", "dq"):  # the atomic dK/dV sum in a varying order
            assert torch.equal(poisoned[out][outside], clean[out][outside]), f"{out} of another sequence changed"
    assert configs is None or gluon_unavailable_reason() is None, gluon_unavailable_reason()


# Lengths around the tile sizes (0, 1, 63-65, 127-129, one tile exactly), Nq != Nk, the modifiers, D = 192 / Dv = 128,
# and a heads-major packed layout: every case reaches the Gluon forward (no seqlens_k; D, Dv in its scope).
GLUON_CASES = {
    "causal": VarlenCase(
        (65, 0, 1, 129, 300), (65, 7, 1, 127, 350), 4, 2, 128, 128, True, None, 0.0, "none", F16, "contiguous", None, 3
    ),
    "window-softcap-alibi": VarlenCase(
        (128, 63, 200), (128, 64, 190), 4, 1, 64, 64, False, (50, 9), 10.0, "batch-heads", F16, "heads-major", None, 4
    ),
    "d192-dv128": VarlenCase(
        (130, 70), (130, 200), 2, 2, 192, 128, True, None, 0.0, "none", F16, "contiguous", None, 5
    ),
    # D = 256 (on the warp-specialised 128x64 tile the producer warp zeroes the V rows past a sequence's end)
    "wide-d256-softcap": VarlenCase(
        (65, 0, 1, 129, 300), (65, 7, 1, 127, 350), 4, 2, 256, 256, True, None, 30.0, "none", F16, "contiguous",
        None, 13,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GLUON_CASES))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("forward", GLUON_FORWARD, ids=str)
def test_gluon_forward_on_packed_batches(forward, dtype, case):
    """Every non-persistent Gluon forward config, pinned, on packed batches: o and lse of each sequence (and the
    gradients, from the tuned backward on that forward's o and lse) within SPEC.md's bound of the float64 oracle;
    every row of o written (the outputs start as NaN)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    case = dataclasses.replace(GLUON_CASES[case], dtype=dtype)
    dims = (case.head_dim, case.head_dim_v)
    fitting = candidates("forward", head_dim_tile(case.head_dim), dtype, torch.device("cuda"), gluon_head_dims=dims)
    if forward not in fitting:
        pytest.skip(f"{forward} does not fit the shared memory at D={dims[0]} Dv={dims[1]} (the tuner drops it)")
    reasons = _gluon_reasons(case.make(), KernelVariant.FORWARD, case.causal, **case.modifiers)
    assert not reasons, reasons
    _check(attnzoo.get("triton_2kernel", configs={"forward": forward}), case)
    # A Gluon compilation error would have switched the Triton twin in, with a warning only.
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


# Every case in the Gluon dK/dV kernel's scope (sliding windows, the soft cap and ALiBi): key blocks
# cut by a sequence's end at 1, 63-65 and 127-129 keys, Q tiles cut likewise, empty sequences, Nq != Nk, GQA, a
# heads-major layout, a causal window, ALiBi slopes per (sequence, head), all three modifiers together.
GLUON_DKDV_CASES = {
    "causal-d128": GLUON_CASES["causal"],
    "full-d64-gqa": VarlenCase(
        (64, 129, 0, 200, 1), (63, 128, 5, 257, 1), 8, 2, 64, 64, False, None, 0.0, "none", F16, "heads-major",
        None, 6,
    ),
    "causal-d64": VarlenCase(
        (300, 65, 127), (330, 64, 129), 4, 4, 64, 64, True, None, 0.0, "none", F16, "contiguous", None, 7
    ),
    "window-d128": VarlenCase(
        (65, 1, 200, 129), (70, 1, 190, 129), 4, 2, 128, 128, True, (60, 0), 0.0, "none", F16, "contiguous", None, 8
    ),
    "alibi-d64-gqa": VarlenCase(
        (200, 65, 1), (190, 64, 129), 4, 2, 64, 64, True, None, 0.0, "batch-heads", F16, "contiguous", None, 9
    ),
    "window-softcap-alibi-d64": GLUON_CASES["window-softcap-alibi"],
    # The head-dim-split kernels above D = 128 (backward_gluon_wide.py; their one tile, 64 x 64): D = 256 causal with
    # the cuts above, and D = 192 with Dv = 128, GQA (dK's and dV's head offsets differ) and all three modifiers in a
    # heads-major layout.
    "wide-causal-d256": VarlenCase(
        (65, 0, 1, 129, 300), (65, 7, 1, 127, 350), 4, 2, 256, 256, True, None, 0.0, "none", F16, "contiguous", None,
        11,
    ),
    "wide-window-softcap-alibi-d192": VarlenCase(
        (128, 63, 200), (128, 64, 190), 4, 2, 192, 128, False, (50, 9), 10.0, "batch-heads", F16, "heads-major",
        None, 12,
    ),
    # Four query heads on each K/V head (the dK/dV kernel's tail barrier turns four times a block), and a sequence
    # with queries but no keys (the dQ kernel's one forced tile is zeroed whole; its rows get dQ = 0).
    "wide-gqa4-no-keys-d256": VarlenCase(
        (70, 65, 129), (100, 0, 130), 8, 2, 256, 256, False, None, 0.0, "none", F16, "contiguous", None, 14,
    ),
    "wide-gqa4-no-keys-d192": VarlenCase(
        (70, 65, 129), (100, 0, 130), 8, 2, 192, 128, True, None, 0.0, "heads", F16, "contiguous", None, 15,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GLUON_DKDV_CASES))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize(
    ("kernel", "cfg"), [("dkdv", c) for c in GLUON_DKDV] + [("dq", c) for c in GLUON_DQ], ids=lambda x: str(x)
)
def test_gluon_backward_kernels_on_packed_batches(kernel, cfg, dtype, case):
    """Every Gluon dK/dV and dQ config, pinned, on packed batches: the gradients of each sequence within SPEC.md's
    bound of the float64 oracle (with o and lse of the tuned forward, and the other backward kernel tuned), every
    row written (the outputs start as NaN)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    case = dataclasses.replace(GLUON_DKDV_CASES[case], dtype=dtype)
    dims = (case.head_dim, case.head_dim_v)
    fitting = candidates(kernel, head_dim_tile(case.head_dim), dtype, torch.device("cuda"), gluon_head_dims=dims)
    if case.head_dim > 128:  # the head-dim-split kernels' one tile must run, never be skipped
        assert WIDE_GLUON_TILE in fitting, fitting
    if cfg not in fitting:
        pytest.skip(f"{cfg} is not a candidate at D={dims[0]} Dv={dims[1]} (shared memory or registers: dropped)")
    reasons = _gluon_reasons(case.make(), VARIANTS[kernel], case.causal, **case.modifiers)
    assert not reasons, reasons
    _check(attnzoo.get("triton_2kernel", configs={kernel: cfg}), case)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("forward", ["128x64 w8 s2 gluon", "64x64 w4 s2 gluon"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
def test_the_wide_kernels_write_no_row_past_the_last_sequence(dims, forward):
    """The Gluon forward and the head-dim-split dQ and dK/dV kernels, launched on packed tensors with 64 spare rows
    past the last sequence (``cu_seqlens[-1] < total``): a block that a sequence's end cuts leaves by masked stores,
    so the spare rows of o, lse, dq, lse2, Delta, dk and dv keep what they held (a TMA store would write them), and
    the NaN in the spare rows of q, k, v and dO, which the last blocks' TMA boxes read, reaches no output (those
    rows are zeroed before any product).  The sequences' rows match the launch layer's call on the trimmed tensors
    (the same kernels)."""
    from attnzoo.kernels.backward_gluon_wide import attention_dkdv_wide_hopper, attention_dq_wide_hopper
    from attnzoo.kernels.forward_gluon import attention_forward_hopper

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    D, Dv = dims
    cfg = KernelConfig.parse(forward)
    if cfg not in candidates("forward", head_dim_tile(D), F16, torch.device("cuda"), gluon_head_dims=dims):
        pytest.skip(f"{cfg} does not fit the shared memory at D={D} Dv={Dv}")
    x = random_varlen_inputs((100, 70), (90, 75), 4, 2, D, dtype=F16, device="cuda", seed=21, head_dim_v=Dv)
    causal, spare, sentinel = True, 64, 3.0
    reference = run_varlen_backend(attnzoo.get("triton_2kernel", configs={"forward": cfg}), x, causal=causal)
    call = prepare(x.q, x.k, x.v, validate_varlen(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, None, None, causal))
    assert not _gluon_reasons(x, KernelVariant.FORWARD, causal) and not _gluon_reasons(x, KernelVariant.DQ, causal)

    def padded(t: torch.Tensor, fill: float) -> torch.Tensor:  # [total, ...] -> [total + spare, ...]
        return torch.cat([t, t.new_full((spare, *t.shape[1:]), fill)])

    q, k, v, do = (padded(t, float("nan")) for t in (x.q, x.k, x.v, x.do))
    total_q, total_k, H = x.q.shape[0], x.k.shape[0], x.q.shape[1]
    # The sequences' rows start as NaN (an unwritten one fails), the spare rows as the sentinel.
    o = padded(torch.full_like(reference["o"], float("nan")), sentinel)
    dq, dk, dv = (padded(torch.full_like(t, float("nan")), sentinel) for t in (x.q, x.k, x.v))
    lse, lse2, delta = (torch.full((H, total_q + spare), sentinel, device="cuda") for _ in range(3))
    scale = D**-0.5
    attention_forward_hopper(
        q, k, v, o, lse, scale, causal, call.modifiers, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
        varlen=call.varlen_args,
    )  # fmt: skip
    attention_dq_wide_hopper(
        q, k, v, o, do, lse, lse2, delta, dq, scale, causal, 64, 64, 2, call.modifiers, varlen=call.varlen_args
    )  # fmt: skip
    attention_dkdv_wide_hopper(
        q, k, v, do, lse2, delta, dk, dv, scale, causal, 64, 64, 2, call.modifiers, varlen=call.varlen_args
    )  # fmt: skip
    torch.cuda.synchronize()
    for name, out, rows in (("o", o, total_q), ("dq", dq, total_q), ("dk", dk, total_k), ("dv", dv, total_k)):
        assert torch.equal(out[rows:], torch.full_like(out[rows:], sentinel)), f"{name}: a spare row was written"
        assert torch.isfinite(out[:rows]).all(), f"{name}: NaN from the spare rows"
        torch.testing.assert_close(out[:rows], reference[name], atol=1e-2, rtol=1e-2, msg=name)
    for name, stats in (("lse", lse), ("lse2", lse2), ("delta", delta)):
        assert torch.equal(stats[:, total_q:], torch.full_like(stats[:, total_q:], sentinel)), name
    torch.testing.assert_close(lse[:, :total_q], reference["lse"], atol=1e-3, rtol=1e-3)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


def _inputs(seed=0):
    x = random_varlen_inputs((300, 0, 129, 1000), (333, 17, 129, 990), 8, 2, 64, dtype=F16, device="cuda", seed=seed)
    return x.q, x.k, x.v, x.do, x.cu_seqlens_q, x.cu_seqlens_k


def _attend(backend):
    def attend(q, k, v, cu_q, cu_k):
        return attnzoo.attention_varlen(q, k, v, cu_q, cu_k, 1000, 990, causal=True, backend=backend)

    return attend


def _step(fn, q, k, v, do, cu_q, cu_k):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, cu_q, cu_k)
    out.backward(do)
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("backend", TRITON)
def test_compiled_matches_eager_without_graph_breaks(backend):
    q, k, v, do, cu_q, cu_k = _inputs(seed=1)
    explained = torch._dynamo.explain(_attend(backend))(q, k, v, cu_q, cu_k)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_attend(backend), fullgraph=True)
    expected = _step(_attend(backend), q, k, v, do, cu_q, cu_k)
    got = _step(compiled, q, k, v, do, cu_q, cu_k)
    tol = dict(atol=2e-3, rtol=2e-3) if backend == "triton_atomic" else dict(atol=0, rtol=0)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_no_host_synchronisation_with_hints_once_compiled():
    q, k, v, do, cu_q, cu_k = _inputs(seed=2)
    compiled = torch.compile(_attend("triton_2kernel"), fullgraph=True)
    _step(compiled, q, k, v, do, cu_q, cu_k)  # compiles, and picks the configs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(compiled, q, k, v, do, cu_q, cu_k)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_of_forward_and_backward():
    q, k, v, do, cu_q, cu_k = _inputs(seed=3)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    attend = _attend("triton_2kernel")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles and picks the configs outside the capture
            attend(*leaves, cu_q, cu_k).backward(do)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(*leaves, cu_q, cu_k)
        grads = torch.autograd.grad(out, leaves, do)
    fresh = _inputs(seed=4)
    for x, new in zip(leaves, fresh[:3], strict=True):
        x.detach().copy_(new)
    do.copy_(fresh[3])
    graph.replay()
    expected = _step(attend, *fresh)
    for name, a, b in zip(("o", "dq", "dk", "dv"), [out, *grads], expected, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("backend", TRITON)
def test_operators_pass_opcheck(backend):
    q, k, v, do, cu_q, cu_k = _inputs(seed=5)
    slopes = torch.rand(8, device="cuda") * 0.5
    arguments = (cu_q, cu_k, 1000, 990, True, 0.125, 40, None, 20.0, slopes, backend)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attention_varlen_forward_op, (*leaves, *arguments))
    o, lse = attention_varlen_forward_op(q, k, v, *arguments)
    torch.library.opcheck(attention_varlen_backward_op, (do, q, k, v, o, lse, *arguments))


def test_lse_matches_the_oracle():
    x = random_varlen_inputs((500, 3, 0, 250), (480, 40, 7, 250), 4, 1, 128, dtype=BF16, device="cuda", seed=6)
    o, lse = attnzoo.attention_varlen(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, causal=True, return_lse=True)
    checks = varlen_oracle_for(x, True, device="cuda").check(dict(o=o, lse=lse))
    assert all(c.ok for c in checks.values()), {n: c.message for n, c in checks.items()}
