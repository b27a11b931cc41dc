"""Ring attention measured on several GPUs: its results against one GPU's, and how it scales.

Run under ``torchrun``, one process a GPU (NCCL; gloo on CPUs)::

    torchrun --nproc-per-node=2 -m attnzoo.bench.ring_scaling --out-dir bench/results --name h100x2_ring

Two tables, each a CSV (``<name>_check.csv``, ``<name>.csv``), and a plot (``<name>.png``):

- **check**: for each layout and mask, the ring's ``o``, ``lse``, ``dq``, ``dk``, ``dv`` on ``W`` ranks (unsharded)
  and one GPU's ``attention()`` on the whole sequence, each judged against the float64 oracle under SPEC.md's rule
  (error / bound), and the largest difference between the two.
- **scaling**: for each whole length N, mask, layout and ring size W (1, 2, 4, ... up to the processes started;
  the ranks past W wait), the per-rank time of the forward and of the backward, timed three ways:

  * ``ms``: the ring as it runs (each step's transfer started before its attention and waited on after it);
  * ``compute_only_ms``: the same steps with each transfer replaced by a copy of the block into the receive buffer
    on the GPU (the same kernels on real data, nothing crossing the link).  The copies are work the real ring does
    not do: at the device's copy rate they take about 11 us for a 32k ring's K/V block, so ``exposed_ms`` reads low
    (and ``hidden_fraction`` high) by about that much;
  * ``transfers_only_ms``: the same transfers in the same order, with no attention between them.

  From those: ``exposed_ms``, the median over rounds of the ring's time less its compute-only time (the two are
  called alternately, so each difference comes from neighbouring calls), and ``hidden_fraction = 1 - exposed_ms /
  transfers_only_ms`` (1: every transfer ran under the attention; 0: none did; clamped to [0, 1]: where the
  transfers take less time than the calls' jitter the fraction is not resolved, and ``exposed_ms`` shows it);
  per-rank TFLOP/s (SPEC.md's count of the whole problem over W ranks), ``speedup`` (the W = 1 time at the same N
  over this time; W = 1 is the ring's operator on a group of one rank: one local call, merged into the float32
  accumulator) and ``efficiency`` (speedup / W).  The cost model (:mod:`attnzoo.bench.ring_model`) predicts each
  zigzag or non-causal W > 1 time (it does not describe the contiguous causal ring) from this run's W = 1
  throughputs and the link bandwidth and one-byte shift time measured here; ``predicted_ms`` and
  ``predicted_hidden`` are its values.

A timing is the median over ``--repeat`` calls or more (short calls: up to 20, about ``--budget-ms`` of them), after an
untimed call and 200 ms of untimed calls; each call starts after a barrier of the ring's ranks and ends when every
one of them has finished (the slowest rank's time; on the GPU, CUDA events around the call, queued behind a sleep
so that the host's launch costs stay hidden as in a training step).  The GPUs first run two seconds of matrix
products.  The ranks past W wait in a barrier of the whole group while a smaller ring runs, so that phase must end
within the group's timeout (10 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .. import testing
from ..autograd import attention_forward_op, backend_key, default_scale
from ..distributed import attention as ring_attn
from ..distributed.layout import LAYOUTS
from ..distributed.ring import TAG_DKV, TAG_KV, Ring, Transfer, group_name
from . import ring_model
from .machine import machine_info
from .schema import backward_flops, forward_flops
from .timing import synchronize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


# -- timing across ranks --------------------------------------------------------------------------------------------
# A sleep queued before each timed call on the GPU (about 5 ms at the H100's 1.98 GHz): the host enqueues the call's
# launches and transfers while the GPU is still busy, so the host's launch costs stay out of the time, as in a
# training step whose GPU queue runs ahead of its host.
_PRELOAD_CYCLES = 10_000_000


def _slowest_ms(fn: Callable[[], object], group: dist.ProcessGroup, device: torch.device) -> float:
    """One call of ``fn`` on every rank of ``group`` after a barrier: the slowest rank's milliseconds (CUDA events
    around the call on the GPU, queued behind a sleep; the host's clock on the CPU)."""
    dist.barrier(group)
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_PRELOAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    else:
        begin = time.perf_counter()
        fn()
        ms = (time.perf_counter() - begin) * 1e3
    elapsed = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def timed_ms(
    fns: Sequence[Callable[[], object]], group: dist.ProcessGroup, device: torch.device, repeat: int,
    warmup_ms: float = 200.0, budget_ms: float = 1000.0, most: int = 20,
) -> list[list[float]]:  # fmt: skip
    """Times (:func:`_slowest_ms`) of each of ``fns``, called in turn round after round so that a drift of the GPU's
    clocks touches them alike.  First one untimed call of each (compilation, tuning, buffers), then untimed rounds
    for ``warmup_ms``, then ``repeat`` timed rounds, or more for short calls (up to ``most``, about ``budget_ms`` in
    all).  The counts come from the slowest rank's probe round, so every rank makes the same calls and none waits on
    a collective another never starts."""
    for fn in fns:
        fn()
    probe = sum(_slowest_ms(fn, group, device) for fn in fns)
    for _ in range(math.ceil(warmup_ms / probe) - 1):
        for fn in fns:
            fn()
    rounds = max(repeat, min(most, math.ceil(budget_ms / probe)))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, own in zip(fns, times, strict=True):
            own.append(_slowest_ms(fn, group, device))
    return times


def warm_up_gpu(device: torch.device, seconds: float = 2.0) -> None:
    """Matrix products for ``seconds``, so that the first timings find the GPU at its working clocks."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def local_copies() -> Iterator[None]:
    """The ring with each shift replaced by a copy of the block into the receive buffer: the same steps and
    kernels on real data, and no transfer."""
    original = Ring.shift

    def shift(self: Ring, send: torch.Tensor, recv: torch.Tensor, tag: int) -> Transfer:
        recv.copy_(send)
        return Transfer([], recv, None)

    Ring.shift = shift
    try:
        yield
    finally:
        Ring.shift = original


def transfers_only(link: Ring, kv_numel: int, dtype: torch.dtype, acc_dtype: torch.dtype, device, mode: str):
    """A callable running the transfers of one ring forward (``mode="fwd"``) or backward, in the order
    :mod:`attnzoo.distributed.attention` starts and waits on them, with no attention between them."""
    kv = [torch.empty(kv_numel, dtype=dtype, device=device) for _ in range(2)]
    dkv = [torch.empty(kv_numel, dtype=acc_dtype, device=device) for _ in range(2)]
    world = link.world

    def forward() -> None:
        for step in range(world - 1):
            link.shift(kv[step % 2], kv[(step + 1) % 2], TAG_KV).wait()

    def backward() -> None:
        pending = None
        for step in range(world):
            kv_transfer = link.shift(kv[step % 2], kv[(step + 1) % 2], TAG_KV) if step + 1 < world else None
            if pending is not None:
                pending.wait()
            pending = link.shift(dkv[step % 2], dkv[(step + 1) % 2], TAG_DKV)
            if kv_transfer is not None:
                kv_transfer.wait()
        pending.wait()

    return forward if mode == "fwd" else backward


# -- the check: the ring against one GPU's attention() --------------------------------------------------------------
def check_rows(args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device) -> list[dict]:
    """For each layout and mask: the ring's outputs and one GPU's attention (``attention()``'s operator, which also
    returns lse) on the whole sequence, judged by the float64 oracle (rows on rank 0 of ``group``; other ranks
    return [])."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = []
    for layout in args.layouts:
        for causal in (False, True):
            x = testing.random_inputs(
                args.batch, args.heads, args.kv_heads, args.check_seqlen, args.check_seqlen, args.head_dim,
                dtype=DTYPES[args.dtype], device=device, seed=args.seed,
            )  # fmt: skip
            for t in (x.q, x.k, x.v, x.do):  # the same whole inputs on every rank
                dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
            local = [ring_attn.shard(t, group, layout).detach().requires_grad_() for t in (x.q, x.k, x.v)]
            o, lse = ring_attn.ring_attention(*local, causal, None, group, layout, args.backend, return_lse=True)
            o.backward(ring_attn.shard(x.do, group, layout))
            ring_out = {"o": ring_attn.unshard(o.detach(), group, layout), "lse": ring_attn.unshard(lse, group, layout)}
            for key, t in zip(("dq", "dk", "dv"), local, strict=True):
                ring_out[key] = ring_attn.unshard(t.grad, group, layout)
            if rank != 0:
                continue
            whole = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
            scale = float(default_scale(x.q, None))
            o1, lse1 = attention_forward_op(
                *whole, None, causal, scale, None, None, 0.0, None, backend_key(args.backend)
            )
            o1.backward(x.do)
            single = {"o": o1.detach(), "lse": lse1, "dq": whole[0].grad, "dk": whole[1].grad, "dv": whole[2].grad}
            judge = testing.oracle_for(x, causal, device=device, chunked=True)
            ring_checks, single_checks = judge.check(ring_out), judge.check(single)
            for key in OUTPUTS:
                a, b = ring_out[key].double(), single[key].double()
                finite = torch.isfinite(a) & torch.isfinite(b)
                rows.append(dict(
                    backend=args.backend, dtype=args.dtype, B=args.batch, H=args.heads, Hkv=args.kv_heads,
                    D=args.head_dim, N=args.check_seqlen, ranks=world, layout=layout, causal=causal, output=key,
                    ring_error=ring_checks[key].error, bound=ring_checks[key].bound, ring_ratio=ring_checks[key].ratio,
                    single_error=single_checks[key].error, single_ratio=single_checks[key].ratio,
                    ring_minus_single=float((a - b)[finite].abs().max()) if finite.any() else 0.0,
                    ok=ring_checks[key].ok and bool(torch.equal(torch.isfinite(a), torch.isfinite(b))),
                ))  # fmt: skip
    return rows


# -- scaling --------------------------------------------------------------------------------------------------------
def flops(args: argparse.Namespace, seqlen: int, causal: bool, mode: str) -> float:
    """SPEC.md's count for the whole problem (``schema``'s, as the grid benchmark counts)."""
    count = forward_flops if mode == "fwd" else backward_flops
    return count(args.batch, args.heads, seqlen, args.head_dim, causal)


def _cases(args: argparse.Namespace, world: int) -> list[tuple[str, bool]]:
    """(layout, causal) pairs timed on ``world`` ranks: every layout causal; one non-causal (the layouts then give
    every rank the same work)."""
    if world == 1:
        return [("contiguous", False), ("contiguous", True)]
    return [(args.layouts[0], False)] + [(layout, True) for layout in args.layouts]


def _local_inputs(args, world: int, rank: int, seqlen: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's q, k, v, do (fresh normal values, another draw on each rank) for a whole length ``seqlen``."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank + seqlen)
    shape = (args.batch, seqlen // world, args.head_dim)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    return [torch.randn(shape[0], h, *shape[1:], generator=gen, dtype=DTYPES[args.dtype], device=device) for h in heads]


def _time_case(args, group, device, inputs, layout: str, causal: bool) -> dict[str, tuple[float, ...]]:
    """``{"fwd"|"bwd": (ms, compute_only_ms, transfers_only_ms, exposed_ms)}`` of one ring call on ``inputs``
    (the last three NaN when the ring has one rank)."""
    q, k, v, do = inputs
    common = (causal, float(default_scale(q, None)), None, None, 0.0, group_name(group), layout, args.backend)
    saved: dict[str, torch.Tensor] = {}

    def forward() -> None:
        saved["o"], saved["lse"] = ring_attn.ring_attention_forward_op(q, k, v, *common)

    def backward() -> None:
        ring_attn.ring_attention_backward_op(do, q, k, v, saved["o"], saved["lse"], *common)

    def without_transfers(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with local_copies():
                fn()

        return run

    times = {}
    world = dist.get_world_size(group)
    with torch.no_grad():
        for mode, fn in (("fwd", forward), ("bwd", backward)):
            if mode == "bwd":
                forward()  # the ring's own o and lse
            if world == 1:
                (real,) = timed_ms([fn], group, device, args.repeat, budget_ms=args.budget_ms)
                times[mode] = (statistics.median(real), float("nan"), float("nan"), float("nan"))
                continue
            # The ring and its compute alone alternate, so that their difference (the transfers' exposed time) is
            # taken from neighbouring calls.
            real, alone = timed_ms([fn, without_transfers(fn)], group, device, args.repeat, budget_ms=args.budget_ms)
            moves = transfers_only(Ring(group), k.numel() + v.numel(), k.dtype, torch.float32, device, mode)
            (transfers,) = timed_ms([moves], group, device, args.repeat, budget_ms=args.budget_ms)
            exposed = statistics.median(a - b for a, b in zip(real, alone, strict=True))
            times[mode] = (statistics.median(real), statistics.median(alone), statistics.median(transfers), exposed)
    return times


def scaling_rows(args, group: dist.ProcessGroup, device: torch.device, seqlens: Sequence[int]) -> list[dict]:
    """Every rank of ``group`` times the ring at each of ``seqlens`` (whole lengths); rows on rank 0."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = []
    for seqlen in seqlens:
        inputs = _local_inputs(args, world, rank, seqlen, device)
        for layout, causal in _cases(args, world):
            times = _time_case(args, group, device, inputs, layout, causal)
            if rank != 0:
                continue
            for mode, (ms, compute_ms, transfers_ms, exposed_ms) in times.items():
                hidden = 1 - exposed_ms / transfers_ms if world > 1 else float("nan")
                rows.append(dict(
                    backend=args.backend, dtype=args.dtype, B=args.batch, H=args.heads, Hkv=args.kv_heads,
                    D=args.head_dim, N=seqlen, ranks=world, tokens_per_rank=seqlen // world, layout=layout,
                    causal=causal, mode=mode, ms=ms, compute_only_ms=compute_ms, transfers_only_ms=transfers_ms,
                    exposed_ms=exposed_ms,
                    hidden_fraction=min(1.0, max(0.0, hidden)) if world > 1 else float("nan"),
                    tflops_per_rank=flops(args, seqlen, causal, mode) / world / (ms * 1e-3) / 1e12,
                ))  # fmt: skip
                print(_line(rows[-1]), flush=True)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def measure_link(group: dist.ProcessGroup, device: torch.device, mib: int, repeat: int) -> tuple[float, float]:
    """The ring's link as one shift measures it: (GB/s each way from a shift of ``mib`` MiB, less the one-byte time;
    the time of a one-byte shift in us, which the cost model takes as its latency per step; it also holds the ranks'
    start skew, each rank's timer starting when its own queued sleep ends)."""
    link = Ring(group)
    small = [torch.zeros(1, dtype=torch.uint8, device=device) for _ in range(2)]
    big = [torch.zeros(mib * 2**20, dtype=torch.uint8, device=device) for _ in range(2)]
    (small_ms,) = timed_ms([lambda: link.shift(small[0], small[1], TAG_KV).wait()], group, device, 20)
    (big_ms,) = timed_ms([lambda: link.shift(big[0], big[1], TAG_KV).wait()], group, device, repeat)
    latency_ms, big_ms = statistics.median(small_ms), statistics.median(big_ms)
    gbps = big[0].numel() * big[0].element_size() / ((big_ms - latency_ms) * 1e-3) / 1e9
    return gbps, latency_ms * 1e3


def add_derived(rows: list[dict], gbps: float, latency_us: float) -> None:
    """``speedup`` and ``efficiency`` against W = 1, and the cost model's prediction from this run's W = 1
    throughputs (the model's non-causal blocks at ``n`` tokens: the non-causal W = 1 row at N = n)."""
    single = {(r["N"], r["causal"], r["mode"]): r for r in rows if r["ranks"] == 1}
    points: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    for (n, causal, mode), r in sorted(single.items()):
        points.setdefault((mode, causal), []).append((n, r["tflops_per_rank"]))
    thr = ring_model.Throughput(points, "this run, 1 rank") if len(points) == 4 else None
    for r in rows:
        base = single.get((r["N"], r["causal"], r["mode"]))
        r["speedup"] = base["ms"] / r["ms"] if base else float("nan")
        r["efficiency"] = r["speedup"] / r["ranks"]
        r["link_gbps"], r["latency_us"] = gbps, latency_us
        r["predicted_ms"] = r["predicted_hidden"] = float("nan")
        zigzag_or_full = r["layout"] == "zigzag" or not r["causal"]
        if thr is None or r["ranks"] == 1 or not zigzag_or_full:
            continue  # the model describes the zigzag ring (and any layout without a mask)
        shape = ring_model.Shape(r["B"], r["H"], r["Hkv"], r["D"], r["dtype"])
        p = ring_model.predict(thr, shape, "measured", gbps, r["ranks"], r["N"], r["causal"], r["mode"], latency_us)
        tail = ring_model.return_ms(shape, p.tokens_per_rank, gbps, latency_us) if r["mode"] == "bwd" else 0.0
        transfers = p.step_transfer_ms * (r["ranks"] - 1) + tail
        r["predicted_ms"] = p.rank_ms
        r["predicted_hidden"] = min(1.0, max(0.0, 1 - p.exposed_transfer_ms / transfers))


def _line(r: dict) -> str:
    hidden = "" if r["ranks"] == 1 else f" hidden {r['hidden_fraction']:.2f}"
    return (f"N={r['N']:>7} W={r['ranks']} {r['layout']:10s} causal={r['causal']!s:5} {r['mode']}: {r['ms']:10.2f} ms"
            f" {r['tflops_per_rank']:6.1f} TFLOP/s/rank{hidden}")  # fmt: skip


# -- output ---------------------------------------------------------------------------------------------------------
def write_csv(path: Path, rows: list[dict], info: dict[str, str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*info, *rows[0]])
        writer.writeheader()
        for row in rows:
            writer.writerow({**info, **{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items()}})


def _series(rows: list[dict], case: tuple, mode: str) -> list[dict]:
    return sorted((r for r in rows if (r["ranks"], r["layout"], r["causal"], r["mode"]) == (*case, mode)),
                  key=lambda r: r["N"])  # fmt: skip


def _label(world: int, layout: str, causal: bool) -> str:
    return f"W={world} " + ("" if world == 1 else f"{layout} ") + ("causal" if causal else "full")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Per-rank TFLOP/s (forward, backward); the transfers' share of the ring's time, alone and exposed; the
    measured time over the cost model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    cases = sorted({(r["ranks"], r["layout"], r["causal"]) for r in rows})
    colors = {case: f"C{i}" for i, case in enumerate(cases)}
    for ax, mode in zip(axes[:2], ("fwd", "bwd"), strict=True):
        for case in cases:
            sel = _series(rows, case, mode)
            ax.plot([r["N"] for r in sel], [r["tflops_per_rank"] for r in sel], "-o" if case[2] else "--s",
                    color=colors[case], label=_label(*case))  # fmt: skip
        ax.set(xlabel="whole sequence N", ylabel="TFLOP/s per rank", title=f"{mode}: per-rank throughput")
    shares, model = axes[2], axes[3]
    for case in (c for c in cases if c[0] > 1):
        for mode, marker in (("fwd", "o"), ("bwd", "^")):
            sel = _series(rows, case, mode)
            n = [r["N"] for r in sel]
            label = f"{_label(*case)} {mode}"
            shares.plot(n, [100 * r["transfers_only_ms"] / r["ms"] for r in sel], ":" + marker, color=colors[case])
            shares.plot(n, [100 * r["exposed_ms"] / r["ms"] for r in sel], "-" + marker, color=colors[case],
                        label=label)  # fmt: skip
            predicted = [(r["N"], r["ms"] / r["predicted_ms"]) for r in sel if r["predicted_ms"] == r["predicted_ms"]]
            if predicted:
                model.plot(*zip(*predicted, strict=True), "-" + marker, color=colors[case], label=label)
    shares.axhline(0, color="k", lw=0.8)
    shares.set(xlabel="whole sequence N", ylabel="% of the ring's time",
               title="transfers alone (dotted) and exposed (ring - compute alone)")  # fmt: skip
    model.axhline(1, color="k", lw=0.8)
    model.set(xlabel="whole sequence N", ylabel="measured / predicted time", title="against the cost model")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(row: dict) -> str:
    """The plot's title from a row (with the machine's columns)."""
    return (f"ring attention, {row['gpu_name']} x {row['ranks_started']}, {row['backend']}, {row['dtype']}, "
            f"B={row['B']} H={row['H']} Hkv={row['Hkv']} D={row['D']}")  # fmt: skip


def read_rows(path: Path) -> list[dict]:
    """The scaling rows of a CSV this module wrote, with their numbers and flags parsed back."""
    numbers = {"N", "ranks", "B", "H", "Hkv", "D", "tokens_per_rank", "ranks_started"}
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row: dict = {}
            for key, value in raw.items():
                if key in numbers:
                    row[key] = int(value)
                elif value in ("True", "False"):
                    row[key] = value == "True"
                else:
                    try:
                        row[key] = float(value)
                    except ValueError:
                        row[key] = value
            rows.append(row)
    return rows


# -- the run --------------------------------------------------------------------------------------------------------
def ring_sizes(world: int) -> list[int]:
    """1, 2, 4, ... up to ``world``."""
    return [w for w in (2**i for i in range(world.bit_length())) if w <= world]


def run(args: argparse.Namespace, device: torch.device) -> tuple[list[dict], list[dict]]:
    """Both tables on the initialized default group (every rank calls it; rows returned on global rank 0)."""
    world = dist.get_world_size()
    warm_up_gpu(device)
    groups = {w: dist.new_group(list(range(w))) if w < world else dist.group.WORLD for w in ring_sizes(world)}
    checks: list[dict] = []
    if args.check_seqlen and world > 1:
        checks = check_rows(args, dist.group.WORLD, device)
    rows: list[dict] = []
    for w, group in groups.items():
        # W = 1 also runs at the lengths a rank holds on the larger rings (the cost model's compute per step).
        seqlens = sorted({n // v for n in args.seqlens for v in groups}) if w == 1 else args.seqlens
        if dist.get_rank() < w:
            rows += scaling_rows(args, group, device, seqlens)
        dist.barrier()
    gbps = latency_us = float("nan")
    if world > 1:
        gbps, latency_us = measure_link(dist.group.WORLD, device, args.link_mib, args.repeat)
    if dist.get_rank() == 0:
        add_derived(rows, gbps, latency_us)
    return checks, rows


def summary(checks: list[dict], rows: list[dict]) -> list[str]:
    lines = []
    if checks:
        worst = max(checks, key=lambda r: r["ring_ratio"])
        lines.append(f"check: {sum(r['ok'] for r in checks)}/{len(checks)} outputs within SPEC's bound; worst ring "
                     f"error/bound {worst['ring_ratio']:.3f} ({worst['layout']} causal={worst['causal']} "
                     f"{worst['output']}), one GPU's {max(r['single_ratio'] for r in checks):.3f}")  # fmt: skip
    lines.append("    N  W layout     causal mode      ms  TFLOP/s/rank  hidden  predicted_ms  pred_hidden  efficiency")
    for r in rows:
        lines.append(
            f"{r['N']:>7} {r['ranks']} {r['layout']:10s} {r['causal']!s:6} {r['mode']:4} {r['ms']:9.2f} "
            f"{r['tflops_per_rank']:8.1f} {r['hidden_fraction']:9.2f} {r['predicted_ms']:11.2f} "
            f"{r['predicted_hidden']:11.2f} {r['efficiency']:10.2f}"
        )
    if rows:
        lines.append(f"link: {rows[0]['link_gbps']:.1f} GB/s each way, {rows[0]['latency_us']:.1f} us per shift")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnzoo.bench.ring_scaling", description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="32768,65536,131072,262144,524288", help="whole sequence lengths N")
    p.add_argument("--check-seqlen", type=int, default=8192, help="N of the check (0: no check)")
    p.add_argument("--layouts", default="zigzag,contiguous", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--backend", default="triton_2kernel", help="the local kernel (default triton_2kernel)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads (default 2: H / Hkv = 4, as Llama 3 8B's 32/8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="timed calls per point at least (default 3)")
    p.add_argument("--budget-ms", type=float, default=1000.0, help="more timed calls, up to 20, for about this long")
    p.add_argument("--link-mib", type=int, default=256, help="MiB of the shift that measures the link (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="ring_scaling", help="file stem of the CSVs and PNG")
    p.add_argument("--replot", metavar="CSV", help="only redraw the plot of a scaling CSV (no process group)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.seqlens = [int(n) for n in args.seqlens.split(",")]
    except ValueError:
        p.error(f"--seqlens must be comma-separated integers, got {args.seqlens!r}")
    args.layouts = args.layouts.split(",")
    if any(layout not in LAYOUTS for layout in args.layouts):
        p.error(f"--layouts must be of {', '.join(LAYOUTS)}, got {','.join(args.layouts)}")
    return args


def write(args: argparse.Namespace, device: torch.device, checks: list[dict], rows: list[dict]) -> list[Path]:
    """The CSVs and the plot under ``--out-dir`` (global rank 0 only)."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    info["ranks_started"] = str(dist.get_world_size())
    paths = []
    if checks:
        write_csv(out / f"{args.name}_check.csv", checks, info)
        paths.append(out / f"{args.name}_check.csv")
    if rows:
        write_csv(out / f"{args.name}.csv", rows, info)
        plot(rows, out / f"{args.name}.png", _title({**info, **rows[0]}))
        paths += [out / f"{args.name}.csv", out / f"{args.name}.png"]
    return paths


def run_and_write(args: argparse.Namespace, device: torch.device) -> bool:
    """Every rank: both tables; global rank 0 writes them and prints the summary.  True when every check passed."""
    checks, rows = run(args, device)
    if dist.get_rank() == 0:
        paths = write(args, device, checks, rows)
        print("\n".join(summary(checks, rows)))
        print("wrote " + ", ".join(map(str, paths)))
    return all(r["ok"] for r in checks)


def spawned(rank: int, world: int, init_method: str, argv: Sequence[str]) -> None:
    """A ``torch.multiprocessing`` worker: the benchmark on the CPU in a gloo group of ``world`` processes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        if not run_and_write(parse_args(argv), torch.device("cpu")):
            raise AssertionError("a ring output is out of SPEC.md's bound (see the check CSV)")
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        rows = read_rows(Path(args.replot))
        plot(rows, Path(args.replot).with_suffix(".png"), _title(rows[0]))
        return 0
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        passed = run_and_write(args, device)
    finally:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
