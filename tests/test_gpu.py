"""GPU tests of the Triton backends (``pytest -m gpu``; skipped without CUDA).

Large shapes are judged by SPEC.md's rule against the float64 oracle run *on the GPU in float64*, one (batch, query
head) at a time so that the N x N score matrix fits (``attnzoo.oracle.reference_chunked``); the low-precision
baseline ("plain PyTorch in the input dtype") is computed the same way.  Small shapes use the CPU oracle.
"""

from __future__ import annotations

import os

import pytest
import torch
from every_candidate import SHARDS, check_every_candidate

import attnzoo
from attnzoo import oracle
from attnzoo.kernels import compiled_launch, tuning
from attnzoo.kernels.backward_2kernel import attention_backward_2kernel
from attnzoo.kernels.backward_atomic import attention_backward_atomic
from attnzoo.kernels.forward import attention_forward
from attnzoo.kernels.gluon_hopper import gluon_unavailable_reason
from attnzoo.kernels.launch import KernelVariant, PreparedCall, prepare
from attnzoo.kernels.tuning import CANDIDATES, KernelConfig
from attnzoo.testing import AttentionInputs, oracle_for, random_inputs
from attnzoo.validation import validate_forward

pytestmark = pytest.mark.gpu


def _prepared(q, k, v, scale, causal, seqlens_k=None, forced=None) -> PreparedCall:
    """The launch layer's prepared call of validated inputs (kernels then run with ``forced`` configs or tuned)."""
    return prepare(q, k, v, validate_forward(q, k, v, causal, scale, seqlens_k), forced=forced)


CUDA = "cuda"
TRITON = ("triton_2kernel", "triton_atomic")
NAMES = ("o", "lse", "dq", "dk", "dv")


def _report(line: str) -> None:
    """Print a result line, and append it to $ATTNZOO_GPU_REPORT if set (pytest-xdist workers do not print)."""
    print("\n" + line)
    path = os.environ.get("ATTNZOO_GPU_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def _make(B, H, Hkv, Nq, Nk, D, dtype, seqlens=None, seed=0):
    x = random_inputs(B, H, Hkv, Nq, Nk, D, dtype=dtype, device=CUDA, seed=seed, seqlens_k=seqlens)
    return x.q, x.k, x.v, x.do, x.seqlens_k


def _gpu_oracle_errors(outputs, q, k, v, do, causal, seqlens):
    """{name: (error, bound)} of ``outputs`` (o, lse, dq, dk, dv) under SPEC.md's rule, against the float64 oracle
    computed on the GPU one (batch, query head) at a time, so that the N x N float64 matrices fit."""
    judge = oracle_for(AttentionInputs(q, k, v, do, seqlens), causal, device=CUDA, chunked=True)
    checks = judge.check(dict(zip(NAMES, outputs, strict=True)))  # NaN, or lse not -inf on empty rows: error > bound
    return {name: (check.error, check.bound) for name, check in checks.items()}


def _run(backend, q, k, v, do, causal, sl):
    o, lse = backend.forward(q, k, v, causal=causal, seqlens_k=sl)
    dq, dk, dv = backend.backward(do, q, k, v, o, lse, causal=causal, seqlens_k=sl)
    torch.cuda.synchronize()
    return o, lse, dq, dk, dv


LARGE = [
    # (dtype, B, H, Hkv, Nq, Nk, D, causal, seqlens_k)
    (torch.float16, 1, 2, 1, 16384, 16384, 128, True, None),
    (torch.bfloat16, 1, 2, 2, 8192, 8192, 64, False, [8000]),
    (torch.float16, 2, 2, 1, 3000, 4096, 256, True, [4096, 2500]),
    (torch.float32, 1, 2, 1, 2048, 2048, 128, True, None),
    (torch.bfloat16, 2, 4, 1, 4096, 4096, 128, True, [0, 3000]),
    (torch.float16, 1, 3, 3, 1000, 1000, 80, False, None),
    # No tile needs the mask (the kernels compile without their masked loop); D=64 folds the scale into exp2.
    (torch.float16, 1, 4, 2, 8192, 8192, 64, False, None),
    (torch.bfloat16, 2, 2, 2, 4096, 4096, 128, False, None),
]


@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("case", LARGE, ids=lambda c: f"{str(c[0])[6:]}-N{c[4]}x{c[5]}-D{c[6]}-c{int(c[7])}")
def test_large_against_gpu_float64_oracle(name, case):
    dtype, B, H, Hkv, Nq, Nk, D, causal, seqlens = case
    q, k, v, do, sl = _make(B, H, Hkv, Nq, Nk, D, dtype, seqlens, seed=Nq + D)
    outputs = _run(attnzoo.get(name), q, k, v, do, causal, sl)
    errors = _gpu_oracle_errors(outputs, q, k, v, do, causal, sl)
    line = " ".join(f"{n}={e:.2e}/{b:.2e}" for n, (e, b) in errors.items())
    _report(f"[oracle] {name} {case[0]} N={Nq}x{Nk} D={D} causal={causal}: {line}")
    for n, (e, b) in errors.items():
        assert e <= b, f"{n}: error {e:.3e} > bound {b:.3e}"


def _small_check(outputs, q, k, v, do, causal, sl):
    """Check five outputs against the CPU float64 oracle (small shapes), as the property tests do."""
    checks = oracle_for(AttentionInputs(q, k, v, do, sl), causal).check(dict(zip(NAMES, outputs, strict=True)))
    for name, check in checks.items():
        assert check.ok, f"{name}: {check.message}"


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize(
    "dtype,D", [(torch.float16, 128), (torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 256)]
)
def test_every_candidate_config_is_correct(dtype, D, shard):
    """Every autotuning candidate of every kernel computes the right thing (or cannot launch: OutOfResources,
    which the tuner skips; those are printed)."""
    q, k, v, do, sl = _make(2, 4, 2, 300, 333, D, dtype, [333, 100], seed=D)
    out_of_resources = check_every_candidate(
        q, k, v, do, lambda outputs: _small_check(outputs, q, k, v, do, True, sl), shard, causal=True, seqlens_k=sl
    )
    _report(f"[configs] {dtype} D={D} out of resources: {out_of_resources}")


# (dtype, B, H, Hkv, Nq, Nk, D, causal, layout): tails on both sides, Nq < Nk and Nq > Nk under the causal mask
# (rows with no visible key), one-tile problems, one query row, grouped-query heads, and [B, N, H, D] memory.
HOPPER_CASES = [
    (torch.float16, 2, 4, 2, 1024, 1024, 128, False, "bhnd"),
    (torch.float16, 2, 4, 2, 1024, 1024, 128, True, "bhnd"),
    (torch.float16, 3, 2, 1, 1000, 1500, 64, True, "bhnd"),
    (torch.bfloat16, 1, 2, 2, 1500, 700, 128, True, "bhnd"),
    (torch.bfloat16, 2, 3, 3, 129, 77, 64, False, "bhnd"),
    (torch.float16, 1, 1, 1, 1, 300, 128, True, "bhnd"),
    (torch.bfloat16, 2, 4, 4, 640, 640, 128, True, "bnhd"),
    (torch.float16, 4, 2, 1, 2048, 2048, 64, False, "bnhd"),
    (torch.bfloat16, 1, 8, 2, 777, 777, 128, True, "bhnd"),
]


def _hopper_case_inputs(dtype, B, H, Hkv, Nq, Nk, D, layout):
    """q, k, v, do of one HOPPER_CASES entry, fresh random; ``bnhd``: [B, N, H, D] memory seen as [B, H, N, D]."""
    layout = "contiguous" if layout == "bhnd" else layout
    x = random_inputs(B, H, Hkv, Nq, Nk, D, dtype=dtype, device=CUDA, seed=Nq * 7 + Nk, layout=layout)
    return x.q, x.k, x.v, x.do


def _needs_hopper() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 GPU")


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
def test_gluon_hopper_forward_against_oracle(cfg):
    """Each ``gluon`` forward candidate runs the Gluon kernel on these inputs (not its Triton twin) and keeps the
    contract: o within SPEC.md's bound of the float64 oracle, lse exact to float32 rounding, -inf on empty rows."""
    _needs_hopper()
    for dtype, B, H, Hkv, Nq, Nk, D, causal, layout in HOPPER_CASES:
        q, k, v, _ = _hopper_case_inputs(dtype, B, H, Hkv, Nq, Nk, D, layout)
        call = _prepared(q, k, v, D**-0.5, causal, forced={"forward": cfg})
        assert not call.gluon_reasons(KernelVariant.FORWARD), call.gluon_reasons(KernelVariant.FORWARD)
        o, lse = attention_forward(call)
        checks = oracle_for(AttentionInputs(q, k, v, None, None), causal, device=CUDA).check({"o": o, "lse": lse})
        errors = []
        for name, check in checks.items():
            assert check.ok, (
                f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} causal={causal}: {name}: {check.message}"
            )
            errors.append(f"{name} {check.error:.2e}/{check.bound:.2e}")
        _report(f"[gluon] {cfg} {str(dtype)[6:]} N={Nq}x{Nk} D={D} causal={causal} {layout}: {' '.join(errors)}")


# (dtype, B, H, Hkv, Nq, Nk, causal): Q and K/V tails, one query row, GQA, Nq != Nk, a key-padded tail, and causal
# with Nq > Nk (rows that see no key: lse = -inf; whole Q blocks of them).
HEAD_DIM_256_CASES = [
    (torch.bfloat16, 2, 4, 2, 1000, 1000, False),
    (torch.float16, 1, 4, 1, 777, 1500, True),
    (torch.bfloat16, 2, 2, 2, 129, 77, False),
    (torch.float16, 1, 2, 2, 1, 300, True),
    (torch.bfloat16, 1, 4, 2, 300, 100, True),
]
# Score modifiers at these head dims, (case, (window, softcap, alibi)), all of which the Gluon forward and the wide
# backward kernels take: a causal sliding window (its left edge cuts tiles), a two-sided band with Nq != Nk, a band
# below the diagonal (rows that see no key); soft caps small enough to bend most scores, causal and not; ALiBi's slopes
# per head (causal: the split into a keys' and a rows' term) and per (batch, head) with Nq > Nk; and Gemma-2's
# combination, a causal window with a soft cap (ALiBi beside them).
MODIFIED_256_CASES = [
    ((torch.bfloat16, 1, 4, 2, 700, 700, True), ((100, 0), 0.0, "none")),
    ((torch.float16, 2, 2, 1, 333, 500, False), ((60, 90), 0.0, "none")),
    ((torch.bfloat16, 1, 2, 2, 300, 300, False), ((None, -40), 0.0, "none")),
    ((torch.float16, 1, 4, 2, 700, 700, True), (None, 2.0, "none")),
    ((torch.bfloat16, 2, 2, 1, 333, 500, False), (None, 5.0, "none")),
    ((torch.bfloat16, 1, 4, 2, 500, 500, True), (None, 0.0, "heads")),
    ((torch.float16, 2, 4, 2, 257, 190, False), (None, 0.0, "batch-heads")),
    ((torch.bfloat16, 1, 4, 4, 700, 700, True), ((200, 0), 3.0, "batch-heads")),
    # causal with Nq != Nk (the rows' positions offset from the keys' in ALiBi's split), both ways
    ((torch.bfloat16, 1, 4, 2, 300, 500, True), (None, 0.0, "heads")),
    ((torch.float16, 1, 2, 2, 500, 300, True), ((100, 0), 2.0, "batch-heads")),
]
NO_MODIFIERS = (None, 0.0, "none")


def _modified_inputs(case, modifiers, head_dim, head_dim_v=None, layout="contiguous", seed=0):
    """The inputs of a MODIFIED_256_CASES entry (or of a plain case with NO_MODIFIERS) on the GPU, the slopes drawn
    by ``random_inputs``, and the keyword arguments of ``validate_forward`` for them."""
    dtype, B, H, Hkv, Nq, Nk, causal = case
    window, softcap, alibi = modifiers
    x = random_inputs(
        B, H, Hkv, Nq, Nk, head_dim, dtype=dtype, device=CUDA, seed=seed, head_dim_v=head_dim_v, layout=layout,
        alibi=alibi,
    )  # fmt: skip
    return x, dict(causal=causal, window=window, softcap=softcap, alibi_slopes=x.alibi_slopes)


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["forward"] if c.gluon], ids=str)
def test_gluon_forward_at_head_dim_256(cfg):
    """D = Dv = 256 through the launch layer with each Gluon config that the tuner keeps there (the others do not
    fit the shared memory), plain and with each score modifier: the Gluon kernel runs (not its Triton twin), o and
    lse within SPEC.md's bound of the float64 oracle, every element written."""
    _needs_hopper()
    for case, modifiers in [(c, NO_MODIFIERS) for c in HEAD_DIM_256_CASES] + MODIFIED_256_CASES:
        dtype, B, H, Hkv, Nq, Nk, causal = case
        if cfg not in tuning.candidates("forward", 256, dtype, torch.device(CUDA), gluon_head_dims=(256, 256)):
            pytest.skip(f"{cfg} does not fit the shared memory at D = 256 (the tuner drops it)")
        x, kw = _modified_inputs(case, modifiers, 256, seed=Nq + Nk)
        call = prepare(x.q, x.k, x.v, validate_forward(x.q, x.k, x.v, scale=256**-0.5, **kw), forced={"forward": cfg})
        assert not call.gluon_reasons(KernelVariant.FORWARD), call.gluon_reasons(KernelVariant.FORWARD)
        o, lse = attention_forward(call)
        inputs = AttentionInputs(x.q, x.k, x.v, None, None, x.alibi_slopes)
        judge = oracle_for(inputs, causal, window=kw["window"], softcap=kw["softcap"], device=CUDA)
        for name, check in judge.check({"o": o, "lse": lse}).items():
            label = f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} causal={causal} modifiers={modifiers}"
            assert check.ok, f"{label}: {name}: {check.message}"
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("q_sets", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_persistent_gluon_forward_runs_several_q_blocks_per_program(dtype, q_sets, monkeypatch):
    """More Q blocks than SMs, so that each persistent program runs several in turn: the K/V rings' slots and
    phases carry from one block to the next, and each block's Q rows load into its set of Q slots once an earlier
    block's O has left through them: with one set (as at D = 192, where two do not fit) the previous block's, with
    two (what D = 64 and 128 get, ``persistent_q_sets``) the block before it, the first set serving at least twice.
    Full, causal (blocks of different lengths, GQA) and windowed calls: o and lse within SPEC.md's bound of the
    float64 oracle, every element written."""
    from attnzoo.kernels import forward_gluon

    _needs_hopper()
    cfg = tuning.KernelConfig.parse("128x128 w8 s2 gluon persistent")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    limit = tuning.shared_memory_limit(torch.device(CUDA))
    for causal, window, N, D in ((False, None, 1000, 128), (True, None, 1536, 64), (True, (300, 0), 1100, 128)):
        B, H, Hkv = 3, 16, 4
        q_blocks = -(-N // 128) * B * H
        assert q_blocks > 2 * sms  # three Q blocks for some programs: their first set of Q slots serves twice
        assert forward_gluon.persistent_q_sets(D, D, 128, 2, dtype.itemsize, limit) == 2
        monkeypatch.setattr(forward_gluon, "persistent_q_sets", lambda *shape_and_limit: q_sets)
        x = random_inputs(B, H, Hkv, N, N, D, dtype=dtype, device=CUDA, seed=N + D)
        call = prepare(x.q, x.k, x.v, validate_forward(x.q, x.k, x.v, causal, window=window), forced={"forward": cfg})
        assert not call.gluon_reasons(KernelVariant.FORWARD), call.gluon_reasons(KernelVariant.FORWARD)
        o, lse = attention_forward(call)
        monkeypatch.undo()
        inputs = AttentionInputs(x.q, x.k, x.v, None, None)
        for name, check in oracle_for(inputs, causal, window=window, device=CUDA).check({"o": o, "lse": lse}).items():
            assert check.ok, f"{dtype} causal={causal} window={window} N={N} D={D}: {name}: {check.message}"


def _check_gradients(label: str, q, k, v, do, causal, o, dq, dk, dv, window=None, softcap=0.0, slopes=None) -> str:
    """dq, dk and dv within SPEC.md's bound of the float64 oracle (stored o's contract term) with the score modifiers
    ``window``, ``softcap`` and ALiBi's ``slopes``; -> the errors/bounds as a report text.  ``label`` names the case
    in a failure."""
    judge = oracle_for(AttentionInputs(q, k, v, do, None, slopes), causal, window=window, softcap=softcap, device=CUDA)
    errors = []
    for name, check in judge.check({"dq": dq, "dk": dk, "dv": dv}, stored_o=o).items():
        assert check.ok, f"{label}: {name}: {check.message}"
        errors.append(f"{name} {check.error:.2e}/{check.bound:.2e}")
    return " ".join(errors)


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["dkdv"] if c.gluon], ids=str)
def test_gluon_hopper_dkdv_against_oracle(cfg):
    """Each ``gluon`` dK/dV candidate runs the Gluon kernel on these inputs (not its Triton twin): dk and dv within
    SPEC.md's bound of the float64 oracle, with tails on both sides, rows that see no key, one query row, grouped-query
    heads summed, and strided memory.  The outputs are NaN-filled first (conftest), so an unwritten row fails."""
    _needs_hopper()
    for dtype, B, H, Hkv, Nq, Nk, D, causal, layout in HOPPER_CASES:
        q, k, v, do = _hopper_case_inputs(dtype, B, H, Hkv, Nq, Nk, D, layout)
        forced = {"forward": CANDIDATES["forward"][0], "dq": CANDIDATES["dq"][0], "dkdv": cfg}
        call = _prepared(q, k, v, D**-0.5, causal, forced=forced)
        assert not call.gluon_reasons(KernelVariant.DKDV, do), call.gluon_reasons(KernelVariant.DKDV, do)
        o, lse = attention_forward(call)
        dq, dk, dv = attention_backward_2kernel(call, do, o, lse)
        label = f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} causal={causal}"
        errors = _check_gradients(label, q, k, v, do, causal, o, dq, dk, dv)
        _report(f"[gluon dkdv] {cfg} {str(dtype)[6:]} N={Nq}x{Nk} D={D} causal={causal} {layout}: {errors}")


# The head dims of the head-dim-split backward kernels (backward_gluon_wide.py): (D, Dv); their cases (case, layout,
# modifiers), contiguous, once with heads and rows transposed ([B, N, H, D] memory: the column parts' descriptors on
# strided views), and the score modifiers.
WIDE_HEAD_DIMS = [(256, 256), (192, 128)]
WIDE_CASES = (
    [(case, "contiguous", NO_MODIFIERS) for case in HEAD_DIM_256_CASES]
    + [(HEAD_DIM_256_CASES[1], "bnhd", NO_MODIFIERS)]
    + [(case, "contiguous", modifiers) for case, modifiers in MODIFIED_256_CASES]
)


@pytest.mark.parametrize("dims", WIDE_HEAD_DIMS, ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
def test_gluon_dkdv_at_wide_head_dims(dims):
    """D = Dv = 256 and D = 192 with Dv = 128 run the head-dim-split dK/dV kernel (``backward_gluon_wide.py``: two
    warpgroups exchanging P^T and dS^T through shared memory, q and k in two column parts) through the launch layer:
    dk and dv (and dq, from the dQ kernel beside it) within SPEC.md's bound of the float64 oracle on the WIDE_CASES
    (Q and K/V tails, one query row, GQA summed, Nq != Nk, causal, a [B, N, H, D] layout, windows, soft caps, ALiBi),
    every element written (NaN-filled first, conftest)."""
    _needs_hopper()
    D, Dv = dims
    cfg = KernelConfig.parse("64x64 w4 s2 gluon")
    for case, layout, modifiers in WIDE_CASES:
        dtype, B, H, Hkv, Nq, Nk, causal = case
        x, kw = _modified_inputs(case, modifiers, D, Dv, layout, seed=Nq + Nk + D + 1)
        do = x.do
        call = prepare(x.q, x.k, x.v, validate_forward(x.q, x.k, x.v, scale=D**-0.5, **kw), forced={"dkdv": cfg})
        assert not call.gluon_reasons(KernelVariant.DKDV, do), call.gluon_reasons(KernelVariant.DKDV, do)
        o, lse = attention_forward(call)
        dq, dk, dv = attention_backward_2kernel(call, do, o, lse)
        label = f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} Dv={Dv} causal={causal} {layout} {modifiers}"
        errors = _check_gradients(
            label, x.q, x.k, x.v, do, causal, o, dq, dk, dv, kw["window"], kw["softcap"], x.alibi_slopes
        )  # fmt: skip
        _report(f"[gluon dkdv wide] {label}: {errors}")
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("dims", WIDE_HEAD_DIMS, ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
def test_gluon_dq_at_wide_head_dims(dims):
    """D = Dv = 256 and D = 192 with Dv = 128 run the head-dim-split dQ kernel (``backward_gluon_wide.py``) through
    the launch layer, beside the Triton dK/dV tile that reads the Delta and lse2 it writes: dq, dk and dv within
    SPEC.md's bound of the float64 oracle on the WIDE_CASES, every element written (NaN-filled first, conftest)."""
    _needs_hopper()
    D, Dv = dims
    forced = {"dq": KernelConfig.parse("64x64 w4 s2 gluon"), "dkdv": KernelConfig.parse("64x32 w8 s2")}
    for case, layout, modifiers in WIDE_CASES:
        dtype, B, H, Hkv, Nq, Nk, causal = case
        x, kw = _modified_inputs(case, modifiers, D, Dv, layout, seed=Nq + Nk + D + 2)
        call = prepare(x.q, x.k, x.v, validate_forward(x.q, x.k, x.v, scale=D**-0.5, **kw), forced=forced)
        o, lse = attention_forward(call)
        assert not call.gluon_reasons(KernelVariant.DQ, x.do, o), call.gluon_reasons(KernelVariant.DQ, x.do, o)
        dq, dk, dv = attention_backward_2kernel(call, x.do, o, lse)
        label = f"{dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} Dv={Dv} causal={causal} {layout} {modifiers}"
        errors = _check_gradients(
            label, x.q, x.k, x.v, x.do, causal, o, dq, dk, dv, kw["window"], kw["softcap"], x.alibi_slopes
        )  # fmt: skip
        _report(f"[gluon dq wide] {label}: {errors}")
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


def test_a_pinned_gluon_tile_the_wide_kernels_lack_runs_its_triton_twin():
    """Above D = 128 the Gluon backward kernels have one tile (64 x 64, two ring slots): a pinned ``gluon`` config of
    other tiles runs the Triton kernel with those tiles, as a gluon config outside the Gluon scope does, and its
    gradients are within SPEC.md's bound of the float64 oracle (not a refusal)."""
    _needs_hopper()
    forced = {"dq": KernelConfig.parse("64x64 w4 s3 gluon"), "dkdv": KernelConfig.parse("64x128 w8 s2 gluon")}
    dtype, B, H, Hkv, Nq, Nk, causal = HEAD_DIM_256_CASES[1]
    x = random_inputs(B, H, Hkv, Nq, Nk, 192, dtype=dtype, device=CUDA, seed=7, head_dim_v=128)
    call = _prepared(x.q, x.k, x.v, 192**-0.5, causal, forced=forced)
    o, lse = attention_forward(call)
    dq, dk, dv = attention_backward_2kernel(call, x.do, o, lse)
    _check_gradients(f"pinned {forced}", x.q, x.k, x.v, x.do, causal, o, dq, dk, dv)


@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["dq"] if c.gluon], ids=str)
def test_gluon_hopper_dq_against_oracle(cfg):
    """Each ``gluon`` dQ candidate runs the Gluon kernel on these inputs (not its Triton twin): dq within SPEC.md's
    bound of the float64 oracle, and dk and dv too (the Triton dK/dV kernel reads the Delta and lse2 that it wrote),
    with tails on both sides, rows that see no key, one query row, grouped-query heads and strided memory.  The
    outputs are NaN-filled first (conftest), so an unwritten row fails."""
    _needs_hopper()
    for dtype, B, H, Hkv, Nq, Nk, D, causal, layout in HOPPER_CASES:
        q, k, v, do = _hopper_case_inputs(dtype, B, H, Hkv, Nq, Nk, D, layout)
        forced = {"forward": CANDIDATES["forward"][0], "dq": cfg, "dkdv": CANDIDATES["dkdv"][0]}
        call = _prepared(q, k, v, D**-0.5, causal, forced=forced)
        o, lse = attention_forward(call)
        assert not call.gluon_reasons(KernelVariant.DQ, do, o), call.gluon_reasons(KernelVariant.DQ, do, o)
        dq, dk, dv = attention_backward_2kernel(call, do, o, lse)
        label = f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} causal={causal}"
        errors = _check_gradients(label, q, k, v, do, causal, o, dq, dk, dv)
        _report(f"[gluon dq] {cfg} {str(dtype)[6:]} N={Nq}x{Nk} D={D} causal={causal} {layout}: {errors}")
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("ordered", [False, True], ids=["atomic-dq", "ordered-dq"])
@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["atomic"] if c.gluon], ids=str)
def test_five_product_backward_matches_the_oracle(cfg, ordered):
    """The five-product backward (``triton_atomic``'s Hopper path: the Gluon dK/dV kernel adding dQ atomically),
    each config pinned, on the HOPPER_CASES: dq, dk and dv within SPEC.md's bound of the float64 oracle; its dQ shares
    added in any order or in the fixed one.  dk and dv are NaN-filled first (conftest), so an unwritten row fails; dQ
    is a sum from zero, which the oracle judges."""
    _needs_hopper()
    variant = KernelVariant.ATOMIC_ORDERED if ordered else KernelVariant.ATOMIC_PREPROCESS
    for dtype, B, H, Hkv, Nq, Nk, D, causal, layout in HOPPER_CASES:
        q, k, v, do = _hopper_case_inputs(dtype, B, H, Hkv, Nq, Nk, D, layout)
        call = _prepared(q, k, v, D**-0.5, causal, forced={"forward": CANDIDATES["forward"][0], "atomic": cfg})
        assert not call.gluon_reasons(variant, do), call.gluon_reasons(variant, do)
        o, lse = attention_forward(call)
        dq, dk, dv = attention_backward_atomic(call, do, o, lse, "preprocess", ordered=ordered)
        label = f"{cfg} {dtype} B={B} H={H}/{Hkv} N={Nq}x{Nk} D={D} causal={causal}"
        errors = _check_gradients(label, q, k, v, do, causal, o, dq, dk, dv)
        _report(f"[five-product ordered={ordered}] {label} {layout}: {errors}")
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("ordered", [False, True], ids=["atomic-dq", "ordered-dq"])
@pytest.mark.parametrize("cfg", [c for c in CANDIDATES["atomic"] if c.gluon], ids=str)
def test_five_product_backward_with_every_score_far_below_zero(cfg, ordered):
    """Rows whose scores are all near -25 (lse far below 0) and a key count that cuts the last K/V block: the keys
    past Nk must add nothing to dQ (unmasked, their dS = -P Delta with P = 2^-lse2 overflows float16: inf * 0 = NaN).
    Fresh random inputs around constant vectors; non-causal, so no mask reaches the last block otherwise."""
    _needs_hopper()
    variant = KernelVariant.ATOMIC_ORDERED if ordered else KernelVariant.ATOMIC_PREPROCESS
    for D in (64, 128):
        g = torch.Generator(device=CUDA).manual_seed(D)
        shape_q, shape_k = (1, 2, 200, D), (1, 2, 200, D)
        level = (25.0 * D**0.5 / D) ** 0.5  # q . k * D^-0.5 = -25
        q = (-level + 0.05 * torch.randn(shape_q, device=CUDA, generator=g)).half()
        k = (level + 0.05 * torch.randn(shape_k, device=CUDA, generator=g)).half()
        v = torch.randn(shape_k, device=CUDA, generator=g).half()
        do = torch.randn(shape_q, device=CUDA, generator=g).half()
        call = _prepared(q, k, v, D**-0.5, False, forced={"forward": CANDIDATES["forward"][0], "atomic": cfg})
        assert not call.gluon_reasons(variant, do), call.gluon_reasons(variant, do)
        o, lse = attention_forward(call)
        assert float(lse.max()) < -15.0  # every row's lse far below 0
        dq, dk, dv = attention_backward_atomic(call, do, o, lse, "preprocess", ordered=ordered)
        _check_gradients(f"{cfg} D={D}", q, k, v, do, False, o, dq, dk, dv)
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", [str(c) for c in CANDIDATES["atomic"] if c.gluon])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_deterministic_atomic_backward_is_bitwise_reproducible(dtype, D, cfg, causal):
    """``triton_atomic(deterministic=True)`` on Hopper, each Gluon config pinned: the dQ shares in a fixed order, so
    repeated backwards are bitwise equal (grouped-query heads, a Q tail; long enough that many K/V blocks add into
    each dQ tile; the causal calls take their Q tiles in descending order, the full ones in ascending order)."""
    _needs_hopper()
    q, k, v, do, _ = _make(2, 8, 2, 4000, 4000, D, dtype, None, seed=3)
    call = _prepared(q, k, v, D**-0.5, causal)
    assert not call.gluon_reasons(KernelVariant.ATOMIC_ORDERED, do)  # the ordered Gluon kernel runs, not a fallback
    be = attnzoo.get("triton_atomic", deterministic=True, configs={"atomic": cfg})
    o, lse = be.forward(q, k, v, causal=causal)
    first = be.backward(do, q, k, v, o, lse, causal=causal)
    for _ in range(3):
        again = be.backward(do, q, k, v, o, lse, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
            assert torch.equal(a, b), name
    errors = _gpu_oracle_errors((o, lse, *first), q, k, v, do, causal, None)
    for n, (e, b) in errors.items():
        assert e <= b, f"{n}: error {e:.3e} > bound {b:.3e}"
    assert gluon_unavailable_reason() is None, gluon_unavailable_reason()


def test_gluon_hopper_scope():
    """The Gluon kernels are used where their contract holds and left for the Triton kernels elsewhere."""
    _needs_hopper()
    q, k, v, do, sl = _make(2, 4, 2, 256, 256, 128, torch.float16, [256, 100])
    forward, dkdv = KernelVariant.FORWARD, KernelVariant.DKDV
    in_scope = _prepared(q, k, v, 0.1, True)
    assert not in_scope.gluon_reasons(forward) and not in_scope.gluon_reasons(dkdv, do)
    assert not in_scope.gluon_reasons(KernelVariant.DQ, do, torch.randn_like(do))  # (do, o)
    outside = {
        "seqlens_k": _prepared(q, k, v, 0.1, True, sl),
        "dtype": _prepared(q.float(), k.float(), v.float(), 0.1, True),
        "head dim": _prepared(q[..., :96], k[..., :96], v[..., :96], 0.1, True),
        # rows 132 * 2 bytes apart: not a multiple of 16 bytes
        "TMA": _prepared(q, torch.randn(2, 2, 256, 132, device=CUDA, dtype=q.dtype)[..., :128], v, 0.1, True),
    }
    for what, call in outside.items():
        for variant in (forward, dkdv):
            reasons = call.gluon_reasons(variant, torch.randn_like(call.q))
            assert reasons and any(what in r for r in reasons), (what, variant, reasons)
    # A negative scale is only the forward's concern (it folds the scale into exp2's argument).
    negative = _prepared(q, k, v, -0.1, True)
    assert any("scale" in r for r in negative.gluon_reasons(forward))
    assert not negative.gluon_reasons(dkdv, do)
    # dO that TMA cannot address keeps the Triton dK/dV kernel.
    strided_do = torch.randn(2, 4, 256, 132, device=CUDA, dtype=q.dtype)[..., :128]
    assert any("do " in r for r in in_scope.gluon_reasons(dkdv, strided_do))
    # No key at all (Nk = 0) is legal and needs no descriptor: every row is empty, through the Triton kernels.
    empty = _prepared(q, k[:, :, :0], v[:, :, :0], 0.1, True)
    assert empty.gluon_reasons(forward) and not empty.kv_descriptors and empty.gluon_reasons(dkdv, do)
    be = attnzoo.get("triton_2kernel")
    o, lse = be.forward(q, k[:, :, :0], v[:, :, :0], causal=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    dq, dk, dv = be.backward(do, q, k[:, :, :0], v[:, :, :0], o, lse, causal=True)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == 0 and dv.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_kernel_backward_is_bitwise_deterministic(dtype):
    q, k, v, do, sl = _make(2, 8, 2, 4096, 4096, 128, dtype, [4096, 3001], seed=1)
    be = attnzoo.get("triton_2kernel")
    o, lse = be.forward(q, k, v, causal=True, seqlens_k=sl)
    first = be.backward(do, q, k, v, o, lse, causal=True, seqlens_k=sl)
    for _ in range(3):
        again = be.backward(do, q, k, v, o, lse, causal=True, seqlens_k=sl)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
    o2, lse2 = be.forward(q, k, v, causal=True, seqlens_k=sl)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


ATOMIC_PATHS = [("preprocess", "128x64 w8 s2"), ("recompute", "128x64 w8 s2"), ("preprocess", "64x128 w8 s2 gluon")]


@pytest.mark.parametrize("delta,config", ATOMIC_PATHS)
def test_atomic_run_to_run_difference_within_tolerance(delta, config):
    """Sums added atomically in a varying order (dK/dV in the Triton kernel, dQ in the Gluon one): report how far
    two runs differ; the other outputs are equal, and both runs meet the oracle rule."""
    dtype = torch.float16
    q, k, v, do, _ = _make(1, 8, 2, 2048, 2048, 128, dtype, None, seed=2)
    gluon = KernelConfig.parse(config).gluon
    if gluon:
        _needs_hopper()
    be = attnzoo.get("triton_atomic", delta=delta, configs={"atomic": config})
    runs = [_run(be, q, k, v, do, True, None) for _ in range(2)]
    diffs = {n: float((a.double() - b.double()).abs().max()) for n, a, b in zip(NAMES, *runs, strict=True)}
    _report(f"[atomic {delta} {config}] max |run1 - run2|: " + " ".join(f"{n}={d:.2e}" for n, d in diffs.items()))
    exact = ("o", "lse", "dk", "dv") if gluon else ("o", "lse", "dq")  # no atomics in these
    assert all(diffs[n] == 0.0 for n in exact), diffs
    for outputs in runs:
        errors = _gpu_oracle_errors(outputs, q, k, v, do, True, None)
        for n, (e, b) in errors.items():
            assert e <= b, f"{n}: error {e:.3e} > bound {b:.3e}"


def test_more_than_2_31_elements():
    """q, k, v of 2^31 + 2^19 elements each (fp16, 4.3 GB): batch offsets overflow int32; check a few batches."""
    B, H, N, D = 4097, 4, 1024, 128
    assert B * H * N * D > 2**31
    dtype = torch.float16
    q, k, v, do, _ = _make(B, H, H, N, N, D, dtype, None, seed=4)
    for name in TRITON:
        be = attnzoo.get(name)
        o, lse = be.forward(q, k, v, causal=True)
        dq, dk, dv = be.backward(do, q, k, v, o, lse, causal=True)
        torch.cuda.synchronize()
        for b in (0, B // 2, B - 1):
            sl = slice(b, b + 1)
            outputs = (o[sl], lse[sl], dq[sl], dk[sl], dv[sl])
            _small_check(outputs, q[sl], k[sl], v[sl], do[sl], True, None)
        del o, lse, dq, dk, dv
        torch.cuda.empty_cache()


def test_tf32_when_allowed():
    """float32 is full IEEE by default and TF32 only when torch allows it (then visibly less exact)."""
    q, k, v, do, _ = _make(1, 2, 2, 512, 512, 64, torch.float32, None, seed=6)
    be = attnzoo.get("triton_2kernel")
    ref = oracle.reference(q, k, v, do)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        ieee = float((be.forward(q, k, v)[0].cpu().double() - ref.o).abs().max())
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = float((be.forward(q, k, v)[0].cpu().double() - ref.o).abs().max())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    _report(f"[tf32] max error ieee {ieee:.2e}, tf32 {tf32:.2e}")
    assert ieee < 2e-5 and 5 * ieee < tf32 < 1e-2


@pytest.mark.parametrize("name", TRITON)
def test_autotuned_results_are_correct(name, monkeypatch, tmp_path):
    """A key timed afresh: the tuner runs every candidate (accumulating into the atomic buffers) first, stores the
    winners on disk, and the results are right."""
    monkeypatch.setenv("ATTNZOO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "AUTOTUNER", tuning.Autotuner())
    q, k, v, do, sl = _make(2, 4, 1, 700, 900, 96, torch.float16, [900, 450], seed=8)
    with tuning.autotuning():
        outputs = _run(attnzoo.get(name), q, k, v, do, True, sl)
    _small_check(outputs, q, k, v, do, True, sl)
    assert tuning.tuned_report() and list(tmp_path.glob("tuning_*.json"))


@pytest.mark.parametrize("name", TRITON)
def test_view_with_a_row_stride_past_int32_tiles(name):
    """A [B, H, N, D] view of [N, B*H*D] memory with a 17M-element row stride: 128-row tiles would need in-tile
    offsets past 2^31, so the host copies the view first; the result must match the contiguous input's."""
    stride = 17_000_000
    storage = torch.randn(256 * stride, device="cuda", dtype=torch.float16)
    q = storage.as_strided((1, 1, 256, 64), (0, 0, stride, 1))
    k, v, do = (torch.randn(1, 1, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    backend = attnzoo.get(name)
    o, lse = backend.forward(q, k, v, causal=True)
    o_ref, lse_ref = backend.forward(q.contiguous(), k, v, causal=True)
    torch.testing.assert_close(o, o_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=0, rtol=0)
    dq, _, _ = backend.backward(do, q, k, v, o, lse, causal=True)
    dq_ref, _, _ = backend.backward(do, q.contiguous(), k, v, o_ref, lse_ref, causal=True)
    torch.testing.assert_close(dq, dq_ref, atol=1e-3, rtol=1e-3)


def _do_of_layout(do: torch.Tensor, layout: str) -> torch.Tensor:
    """``do``'s values in another memory layout: heads-minor strides, or a base 16 or 2 bytes past the allocation."""
    if layout == "transposed":
        return do.transpose(1, 2).contiguous().transpose(1, 2)
    if layout in ("offset 16 bytes", "offset 2 bytes"):
        skip = 8 if layout == "offset 16 bytes" else 1
        flat = torch.empty(do.numel() + skip, dtype=do.dtype, device=do.device)
        flat[skip:].copy_(do.reshape(-1))
        return flat[skip:].view(do.shape)
    return do


@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_repeated_calls_reach_the_compiled_kernels_directly(name, D, monkeypatch):
    """From the second call of a signature on, every launch goes straight to the kernel that Triton found for the
    first (``kernels/compiled_launch.py``).  Fresh inputs and a ``do`` of other strides or alignment, call after
    call: each call's outputs within the oracle's bound, and (``ATTNZOO_CHECK_LAUNCHES``, on in the tests) each
    launch's kernel Triton's own pick for its arguments."""
    monkeypatch.setattr(compiled_launch, "_COMPILED", {})
    backend = attnzoo.get(name)
    layouts = ("contiguous", "transposed", "offset 16 bytes", "offset 2 bytes", "contiguous", "transposed")
    compiled_after = []
    for seed, layout in enumerate(layouts):
        q, k, v, do, _ = _make(2, 4, 2, 200, 261, D, torch.float16, seed=seed)
        do = _do_of_layout(do, layout)
        outputs = _run(backend, q, k, v, do, True, None)
        _small_check(outputs, q, k, v, do, True, None)
        compiled_after.append(len(compiled_launch._COMPILED))
    if compiled_launch.DIRECT_LAUNCHES:  # (Triton 3.6 to 3.9; other versions bind every launch)
        assert compiled_after[0] > 0  # the launches were keyed
        assert compiled_after[-2:] == compiled_after[3:4] * 2  # the layouts seen before reused their kernels
