"""SPEC.md, "Sequence (context) parallelism": ``shard``, ``ring_attention`` and ``unshard`` over torch.distributed.

The unsharded outputs and gradients of random ring cases (2 and 4 gloo processes, every CPU backend as the local
kernel, the Triton ones through the interpreter) are judged by the float64 oracle under SPEC.md's error rule; the
ring's plan is checked against SPEC.md's mask element by element; bad input fails before any transfer.
"""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cases import BF16, F16, F32, F64
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo
from attnzoo import distributed as zd
from attnzoo import oracle
from attnzoo.backend import interpreter_unusable_reason, triton_interpreter_active
from attnzoo.distributed import check
from attnzoo.distributed.attention import ring_attention_backward_op, ring_attention_forward_op, unshard_op
from attnzoo.distributed.layout import assemble, chunks_per_rank, take
from attnzoo.distributed.plan import pieces, ring_plan
from attnzoo.distributed.ring import group_name
from attnzoo.validation import _validate_window

REFERENCE = ["numpy_ref", "torch_fa1", "torch_fa2"]


def _seed() -> int:
    """The run's hypothesis seed (conftest.py prints it), so that ``--hypothesis-seed`` also reproduces the cases
    drawn here for the spawned processes."""
    from hypothesis import core

    return int(core.global_force_seed or 0)


# -- the layouts and the plan, on one process ----------------------------------------------------------------------
@settings(max_examples=60)
@given(world=st.integers(1, 8), layout=st.sampled_from(zd.LAYOUTS), chunk=st.integers(1, 4))
def test_shards_partition_the_sequence_and_assemble_back(world, layout, chunk):
    n = chunk * chunks_per_rank(layout) * world
    x = torch.arange(2 * n, dtype=torch.float64).view(1, 2, n, 1)
    parts = [take(x, rank, world, layout) for rank in range(world)]
    assert torch.equal(assemble(parts, layout), x)
    rows = sorted(int(v) for part in parts for v in part[0, 0, :, 0])
    assert rows == list(range(n)), "every row on exactly one rank"


def _window_side(n: int):
    return st.one_of(st.none(), st.integers(-n - 3, n + 3), st.sampled_from([0, 2**40, -(2**40)]))


@settings(max_examples=150)
@given(
    world=st.integers(1, 6),
    layout=st.sampled_from(zd.LAYOUTS),
    chunk_q=st.integers(1, 4),
    chunk_k=st.integers(1, 4),
    causal=st.booleans(),
    data=st.data(),
)
def test_plan_computes_each_visible_score_exactly_once(world, layout, chunk_q, chunk_k, causal, data):
    """Over all ranks and ring steps, the local calls' own masks (SPEC.md's causal and window, in each call's
    coordinates) put together give SPEC.md's mask of the whole problem, each visible score once; no call is launched
    whose scores are all masked."""
    per_rank = chunks_per_rank(layout)
    n_q, n_k = chunk_q * per_rank, chunk_k * per_rank
    Nq, Nk = n_q * world, n_k * world
    window = None
    if data.draw(st.booleans()):
        window = _validate_window((data.draw(_window_side(Nk)), data.draw(_window_side(Nk))), Nq, Nk)
    covered = torch.zeros(Nq, Nk, dtype=torch.int64)
    for rank in range(world):
        rows_global = torch.cat([torch.arange(p.start, p.start + p.size) for p in pieces(rank, world, layout, n_q)])
        for step, launches in enumerate(ring_plan(rank, world, layout, n_q, n_k, causal, window)):
            src = (rank - step) % world
            keys_global = torch.cat([torch.arange(p.start, p.start + p.size) for p in pieces(src, world, layout, n_k)])
            for launch in launches:
                rows, keys = rows_global[slice(*launch.rows)], keys_global[slice(*launch.keys)]
                mask = oracle.visible_mask(1, len(rows), len(keys), launch.causal, None, window=launch.window)[0, 0]
                assert mask.any(), f"a fully masked call was launched: {launch}"
                covered[rows.view(-1, 1), keys.view(1, -1)] += mask.long()
    expected = oracle.visible_mask(1, Nq, Nk, causal, None, window=window)[0, 0]
    assert torch.equal(covered, expected.long())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64])
def test_zigzag_gives_every_rank_equal_causal_work_at_every_step(world):
    """Zigzag: rank r holds chunks r and 2W-1-r; at each step every rank computes the same number of visible scores,
    in one call."""
    n = 2 * 3  # two chunks of 3 rows per rank
    for step in range(world):
        work = set()
        for rank in range(world):
            (launch,) = ring_plan(rank, world, "zigzag", n, n, True, None)[step]
            rows, keys = launch.rows[1] - launch.rows[0], launch.keys[1] - launch.keys[0]
            mask = oracle.visible_mask(1, rows, keys, launch.causal, None, window=launch.window)
            work.add(int(mask.sum()))
        assert len(work) == 1, f"step {step}: visible scores per rank {work}"


# -- random cases on 2 and 4 gloo processes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def forkserver():
    """Workers forked from one server that imported attnzoo once (a fresh interpreter per worker pays ~5 s of
    imports each; four of them on two cores, four times that)."""
    multiprocessing.set_forkserver_preload(["attnzoo.distributed.check"])
    return "forkserver"


def _spawn(start_method, tmp_path, world, cases, with_compile=False):
    torch.multiprocessing.start_processes(
        check.spawned, args=(world, f"file://{tmp_path}/init", cases, "cpu", with_compile), nprocs=world,
        start_method=start_method,
    )  # fmt: skip


def _triton_cases(world: int) -> list[check.RingCase]:
    """One small float32 case and one float16 case per Triton backend (the interpreter is slow; bfloat16's tl.dot
    is wrong there and is checked on the GPU)."""
    if not triton_interpreter_active() or interpreter_unusable_reason() is not None:
        return []
    rng = random.Random(_seed() + world)
    return [
        case
        for name in ("triton_2kernel", "triton_atomic")
        for case in check.random_cases(rng, world, 2, [name], [F32, F16], max_chunk=4, head_dims=(16,))
    ]


def test_ring_on_two_processes_equals_attention(forkserver, tmp_path):
    cases = check.random_cases(random.Random(_seed()), 2, 24, REFERENCE, [F64, F32, F16, BF16])
    _spawn(forkserver, tmp_path, 2, cases + _triton_cases(2), with_compile=True)


def test_ring_on_four_processes_equals_attention(forkserver, tmp_path):
    cases = check.random_cases(random.Random(_seed() + 4), 4, 16, REFERENCE, [F32, F64, BF16, F16])
    _spawn(forkserver, tmp_path, 4, cases)


@pytest.mark.gpu
def test_ring_on_one_gpu_with_the_triton_kernels(tmp_path):
    """Two ranks sharing the one GPU over gloo (CUDA tensors staged through the host), the Triton backends as the
    local kernels, every dtype."""
    rng = random.Random(_seed())
    # Few cases: each new (dtype, head dim, mask) compiles its kernels, and both ranks compile at once.
    cases = check.random_cases(rng, 2, 6, ["triton_2kernel", "triton_atomic"], [BF16, F16, F32], max_chunk=80)
    torch.multiprocessing.spawn(check.spawned, args=(2, f"file://{tmp_path}/init", cases, "cuda", False), nprocs=2)


# -- one process: a group of one ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/init", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _qkv(Nq=8, Nk=8, H=4, Hkv=2, D=16, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, Nq, D, generator=gen)
    k, v = (torch.randn(2, Hkv, Nk, D, generator=gen) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def test_one_rank_is_attention(group_of_one):
    q, k, v = _qkv(Nq=6, Nk=10, requires_grad=True)
    got = zd.ring_attention(q, k, v, causal=True, layout="zigzag", backend="torch_fa2", window=(3, 1), softcap=2.0)
    want = attnzoo.attention(q, k, v, causal=True, window=(3, 1), softcap=2.0, backend="torch_fa2")
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(zd.unshard(zd.shard(q)), q)


@pytest.mark.parametrize("with_modifiers", [False, True])
def test_operators_pass_opcheck(group_of_one, with_modifiers):
    q, k, v = _qkv(requires_grad=True)
    modifiers = (3, 0, 5.0) if with_modifiers else (None, None, 0.0)
    args = (True, 0.3, *modifiers, group_name(None), "zigzag", "torch_fa2")
    torch.library.opcheck(ring_attention_forward_op, (q, k, v, *args))
    o, lse = ring_attention_forward_op(q, k, v, *args)
    do = torch.randn_like(o)
    torch.library.opcheck(ring_attention_backward_op, (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, *args))
    torch.library.opcheck(unshard_op, (q, group_name(None), "zigzag"))


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        (dict(layout="diagonal"), ValueError, "layout"),
        (dict(q=(2, 4, 7, 16)), ValueError, "multiple of 2"),
        (dict(k=(2, 3, 8, 16), v=(2, 3, 8, 16)), ValueError, "K/V heads"),
        (dict(k=(2, 2, 8, 8)), ValueError, "head dim"),
        (dict(window=(1, 2, 3)), TypeError, "window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(group="world"), TypeError, "group"),
        (dict(backend="flash9"), ValueError, "known backends"),
        (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
        (dict(backend="triton_2kernel", dtype=F64), NotImplementedError, "float64"),
    ],
)
def test_bad_input_fails_before_any_transfer(group_of_one, kwargs, error, names):
    kwargs = dict(kwargs)
    gen = torch.Generator().manual_seed(1)
    dtype = kwargs.pop("dtype", F32)
    shapes = {"q": (2, 4, 8, 16), "k": (2, 2, 8, 16), "v": (2, 2, 8, 16)}
    tensors = {n: torch.randn(kwargs.pop(n, shape), generator=gen, dtype=dtype) for n, shape in shapes.items()}
    with pytest.raises(error, match=names):
        zd.ring_attention(tensors["q"], tensors["k"], tensors["v"], **kwargs)


def test_shard_names_the_bad_argument(group_of_one):
    with pytest.raises(ValueError, match="dim 2"):
        zd.shard(torch.ones(1, 1, 3, 4), layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        zd.shard(torch.ones(1, 1, 4, 4), layout="round-robin")
    with pytest.raises(ValueError, match="at least 3 dims"):
        zd.unshard(torch.ones(4, 4))


# -- the cost model -------------------------------------------------------------------------------------------------
def test_ring_model_crossover_is_where_transfer_meets_compute():
    from attnzoo.bench import ring_model as model

    csv_path = Path(__file__).resolve().parents[1] / "bench" / "results" / "h100_bench_bf16.csv"
    thr = model.read_throughput(csv_path, "triton_2kernel", 128)
    shape = model.Shape(batch=1, heads=32, kv_heads=8, head_dim=128, dtype="bf16")
    for causal in (False, True):
        for mode in ("fwd", "bwd"):
            n = model.crossover(thr, shape, causal, mode, 64.0, 10.0)
            compute, transfer = model.step_times(thr, shape, n, causal, mode, 64.0, 10.0)
            assert transfer <= compute
            compute, transfer = model.step_times(thr, shape, n - 64, causal, mode, 64.0, 10.0)
            assert transfer > compute
    row = model.predict(thr, shape, "pcie-gen5", 64.0, 8, 8 * n, True, "bwd", 10.0)
    assert row.rank_ms >= row.compute_only_ms and 0 < row.efficiency <= 1


# -- the scaling benchmark (its NCCL run is on the GPUs; here two gloo processes) ----------------------------------
def test_ring_scaling_bench_checks_and_times_every_ring_size(forkserver, tmp_path):
    import csv

    from attnzoo.bench import ring_scaling

    argv = ["--seqlens", "64,128", "--check-seqlen", "32", "--backend", "torch_fa2", "--dtype", "fp32", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "16", "--repeat", "1", "--budget-ms", "0", "--link-mib", "1",
            "--out-dir", str(tmp_path), "--name", "ring"]  # fmt: skip
    torch.multiprocessing.start_processes(
        ring_scaling.spawned, args=(2, f"file://{tmp_path}/init", argv), nprocs=2, start_method=forkserver
    )
    with open(tmp_path / "ring_check.csv") as f:
        checks = list(csv.DictReader(f))
    # Both layouts, both masks, every output of the ring on 2 ranks, each within SPEC.md's bound.
    assert sorted({(r["layout"], r["causal"], r["output"]) for r in checks}) == sorted(
        (layout, causal, output) for layout in ("zigzag", "contiguous") for causal in ("False", "True")
        for output in ring_scaling.OUTPUTS
    )  # fmt: skip
    assert all(r["ok"] == "True" and r["ranks"] == "2" and float(r["ring_ratio"]) <= 1 for r in checks)
    with open(tmp_path / "ring.csv") as f:
        rows = list(csv.DictReader(f))
    one = {(int(r["N"]), r["causal"], r["mode"]) for r in rows if r["ranks"] == "1"}
    # One rank also runs the lengths a rank holds on two (32 = 64 / 2): the cost model's compute per step.
    assert one == {(n, c, m) for n in (32, 64, 128) for c in ("False", "True") for m in ("fwd", "bwd")}
    two = [r for r in rows if r["ranks"] == "2"]
    assert sorted((int(r["N"]), r["layout"], r["causal"], r["mode"]) for r in two) == sorted(
        (n, layout, causal, mode) for n in (64, 128) for layout, causal in
        (("zigzag", "False"), ("zigzag", "True"), ("contiguous", "True")) for mode in ("fwd", "bwd")
    )  # fmt: skip
    for r in two:
        assert float(r["ms"]) > 0 and float(r["compute_only_ms"]) > 0 and float(r["transfers_only_ms"]) > 0
        assert 0 <= float(r["hidden_fraction"]) <= 1 and r["exposed_ms"] != "nan"
        base = next(b for b in rows if (b["ranks"], b["N"], b["causal"], b["mode"]) == ("1", r["N"], r["causal"],
                                                                                          r["mode"]))  # fmt: skip
        assert float(r["speedup"]) == pytest.approx(float(base["ms"]) / float(r["ms"]), rel=2e-3)
        modelled = r["layout"] == "zigzag" or r["causal"] == "False"
        assert (float(r["predicted_ms"]) > 0) if modelled else r["predicted_ms"] == "nan"
    assert (tmp_path / "ring.png").stat().st_size > 0
