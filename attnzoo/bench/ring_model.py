"""A cost model of ring attention (``attnzoo.distributed``): per-rank time from measured single-GPU kernel times and a
link bandwidth, the overlap each ring step needs, and the sequence length per rank at which the transfers hide behind
the attention.

Per rank, with ``n = N / W`` tokens and one K/V block of ``n`` tokens moved per step (``W`` steps):

* compute of a step: the attention of ``n`` queries against ``n`` keys, ``4 B H n^2 D`` FLOPs forward (2.5x that
  backward, SPEC.md's count), half of it when causal with the zigzag layout (every step then holds ``n^2 / 2`` visible
  scores, ``docs/design.md``), at the throughput the kernel measured at sequence length ``n`` (read from a
  ``python -m attnzoo bench`` CSV, interpolated in log N; outside the measured 1k..16k the nearest measurement, so
  below 1k the model is optimistic about compute and the crossover it reports is a lower bound);
* transfer of a step: forward, K and V of the block (``2 B Hkv n D`` elements of the input dtype); backward, K and V
  again plus the dK/dV accumulator in float32 (``2 B Hkv n D`` float32), over one direction of the link, plus a fixed
  latency.  The ring sends to one neighbour and receives from the other, so each direction carries one stream;
* a step costs ``max(compute, transfer)`` (the next block travels during this block's attention: double buffering);
  the last step has nothing left to receive, and the backward adds the return of the last dK/dV accumulator.

``overlap needed`` is ``transfer / compute`` of a step: below 1 the transfer hides completely.  The crossover
``n*`` is the smallest ``n`` from which it stays below 1.  The bandwidths are peak figures per direction (cited in
``LINKS``), not measurements: the NCCL measurement on several GPUs is a separate issue.

    python -m attnzoo.bench.ring_model --csv bench/results/h100_bench_bf16.csv --out-dir bench/results
"""

from __future__ import annotations

import argparse
import bisect
import csv
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Peak bandwidth per direction, GB/s (1e9 bytes/s).
LINKS = {
    # NVIDIA H100 SXM datasheet: NVLink 900 GB/s, the total of both directions over 18 links: 450 GB/s each way.
    "nvlink-h100": 450.0,
    # PCIe Gen5 x16 (H100 PCIe datasheet: 128 GB/s, both directions together): 64 GB/s each way.
    "pcie-gen5": 64.0,
    # InfiniBand NDR, one ConnectX-7 port per GPU: 400 Gb/s = 50 GB/s each way.
    "ib-ndr": 50.0,
}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4


@dataclass(frozen=True)
class Throughput:
    """Measured TFLOP/s of one kernel by sequence length, forward and backward, causal or not."""

    points: dict[tuple[str, bool], list[tuple[int, float]]]  # (fwd|bwd, causal) -> sorted [(N, TFLOP/s)]
    source: str

    def at(self, direction: str, causal: bool, n: float) -> float:
        """TFLOP/s at sequence length ``n``: log-linear between measured lengths, the nearest one outside them."""
        pts = self.points[(direction, causal)]
        lengths = [p[0] for p in pts]
        if n <= lengths[0]:
            return pts[0][1]
        if n >= lengths[-1]:
            return pts[-1][1]
        i = bisect.bisect_right(lengths, n)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
        return t0 + w * (t1 - t0)


def read_throughput(path: str | Path, impl: str, head_dim: int) -> Throughput:
    """Forward TFLOP/s from the ``fwd`` rows and backward TFLOP/s from the ``train`` rows of a bench CSV."""
    points: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["impl"] != impl or int(row["D"]) != head_dim or row.get("status", "ok") != "ok":
                continue
            causal = row["causal"] == "yes"
            if row["mode"] == "fwd" and row["tflops_fwd"]:
                points.setdefault(("fwd", causal), []).append((int(row["N"]), float(row["tflops_fwd"])))
            if row["mode"] == "train" and row["tflops_bwd"]:
                points.setdefault(("bwd", causal), []).append((int(row["N"]), float(row["tflops_bwd"])))
    if len(points) != 4:
        raise ValueError(f"{path}: no fwd/train rows of impl {impl!r} at D={head_dim} for both masks")
    return Throughput({key: sorted(pts) for key, pts in points.items()}, Path(path).name)


@dataclass(frozen=True)
class Prediction:
    """One row of the table (times in ms, per rank)."""

    link: str
    gbps: float
    ranks: int
    seqlen: int
    tokens_per_rank: int
    causal: bool
    mode: str
    step_compute_ms: float
    step_transfer_ms: float
    overlap_needed: float
    exposed_transfer_ms: float
    rank_ms: float
    compute_only_ms: float
    efficiency: float
    crossover_tokens_per_rank: int


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str


def step_times(
    thr: Throughput, shape: Shape, n: float, causal: bool, mode: str, gbps: float, latency_us: float
) -> tuple[float, float]:
    """(compute, transfer) of one ring step in ms: ``mode`` "fwd" or "bwd"."""
    flops = 4 * shape.batch * shape.heads * n * n * shape.head_dim * (0.5 if causal else 1.0)
    flops *= 2.5 if mode == "bwd" else 1.0
    # Zigzag steps beyond the first are non-causal blocks: the non-causal throughput of a length-n block.
    compute = flops / (thr.at(mode, False, n) * 1e12) * 1e3
    kv = _kv_elements(shape, n)
    volume = kv * BYTES[shape.dtype] + (kv * FP32_BYTES if mode == "bwd" else 0)
    return compute, _transfer_ms(volume, gbps, latency_us)


def _kv_elements(shape: Shape, n: float) -> float:
    """Elements of one K/V block (K and V of ``n`` tokens)."""
    return 2 * shape.batch * shape.kv_heads * n * shape.head_dim


def _transfer_ms(volume_bytes: float, gbps: float, latency_us: float) -> float:
    return volume_bytes / (gbps * 1e9) * 1e3 + latency_us * 1e-3


def return_ms(shape: Shape, n: float, gbps: float, latency_us: float) -> float:
    """The backward's last transfer: the float32 dK/dV accumulator of ``n`` tokens going home after the last step,
    with no compute left to hide behind."""
    return _transfer_ms(_kv_elements(shape, n) * FP32_BYTES, gbps, latency_us)


def crossover(thr: Throughput, shape: Shape, causal: bool, mode: str, gbps: float, latency_us: float) -> int:
    """The smallest tokens per rank (a multiple of 64, up to 2^20) from which a step's transfer hides behind its
    compute; 0 if it never does in that range."""
    found = 0
    for n in range(2**20, 0, -64):
        compute, transfer = step_times(thr, shape, n, causal, mode, gbps, latency_us)
        if transfer > compute:
            break
        found = n
    return found


def predict(
    thr: Throughput, shape: Shape, link: str, gbps: float, ranks: int, seqlen: int, causal: bool, mode: str,
    latency_us: float,
) -> Prediction:  # fmt: skip
    n = seqlen / ranks
    compute, transfer = step_times(thr, shape, n, causal, mode, gbps, latency_us)
    # Step 0 of the zigzag causal ring is a causal block of the same visible work; timed at the causal throughput.
    first = compute * (thr.at(mode, False, n) / thr.at(mode, True, n)) if causal else compute
    overlapped = max(first, transfer) + (ranks - 2) * max(compute, transfer) + compute if ranks > 1 else first
    tail = return_ms(shape, n, gbps, latency_us) if mode == "bwd" and ranks > 1 else 0.0
    total = overlapped + tail
    compute_only = first + (ranks - 1) * compute
    return Prediction(
        link=link, gbps=gbps, ranks=ranks, seqlen=seqlen, tokens_per_rank=int(n), causal=causal, mode=mode,
        step_compute_ms=compute, step_transfer_ms=transfer, overlap_needed=transfer / compute,
        exposed_transfer_ms=total - compute_only, rank_ms=total, compute_only_ms=compute_only,
        efficiency=compute_only / total,
        crossover_tokens_per_rank=crossover(thr, shape, causal, mode, gbps, latency_us),
    )  # fmt: skip


def table(
    thr: Throughput, shape: Shape, links: dict[str, float], ranks: Sequence[int], seqlens: Sequence[int],
    latency_us: float,
) -> list[Prediction]:  # fmt: skip
    return [
        predict(thr, shape, link, gbps, w, n, causal, mode, latency_us)
        for link, gbps in links.items()
        for n in seqlens
        for causal in (False, True)
        for mode in ("fwd", "bwd")
        for w in ranks
    ]


def plot(thr: Throughput, shape: Shape, links: dict[str, float], rows: list[Prediction], latency_us: float, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    tokens = [2**k for k in range(8, 19)]
    for (link, gbps), color in zip(links.items(), ("C0", "C1", "C2", "C3", "C4"), strict=False):
        for mode, style in (("fwd", "-"), ("bwd", "--")):
            ratio = [step_times(thr, shape, n, True, mode, gbps, latency_us) for n in tokens]
            left.plot(tokens, [t / c for c, t in ratio], style, color=color, label=f"{link} ({gbps:g} GB/s) {mode}")
        for seqlen, marker in zip(sorted({r.seqlen for r in rows}), ("o", "s", "^"), strict=False):
            pts = [r for r in rows if r.link == link and r.seqlen == seqlen and r.causal and r.mode == "fwd"]
            bwd = {r.ranks: r for r in rows if r.link == link and r.seqlen == seqlen and r.causal and r.mode == "bwd"}
            train = [(r.compute_only_ms + bwd[r.ranks].compute_only_ms) / (r.rank_ms + bwd[r.ranks].rank_ms)
                     for r in pts]  # fmt: skip
            right.plot([r.ranks for r in pts], train, marker=marker, color=color, label=f"{link}, N={seqlen // 1024}k")
    left.axhline(1.0, color="k", lw=0.8)
    left.set(xscale="log", yscale="log", xlabel="tokens per rank n", ylabel="transfer / compute per step",
             title="Overlap needed per ring step (causal, zigzag)")  # fmt: skip
    left.legend(fontsize=7)
    right.set_xscale("log", base=2)
    right.minorticks_off()
    right.set(xlabel="ranks W", ylabel="compute / (compute + exposed transfer)", ylim=(0, 1.05),
              title="Predicted train-step efficiency (causal, zigzag)")  # fmt: skip
    right.set_xticks(sorted({r.ranks for r in rows}), [str(w) for w in sorted({r.ranks for r in rows})])
    right.legend(fontsize=7)
    fig.suptitle(
        f"Ring attention model: {thr.source}, B={shape.batch} H={shape.heads} Hkv={shape.kv_heads} D={shape.head_dim}"
        f" {shape.dtype}, latency {latency_us:g} us per step", fontsize=10,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _links(text: str) -> dict[str, float]:
    links = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        links[name] = float(value) if value else LINKS[name]
    return links


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnzoo.bench.ring_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default="bench/results/h100_bench_bf16.csv", help="a python -m attnzoo bench CSV")
    p.add_argument("--impl", default="triton_2kernel", help="the local kernel's rows in the CSV")
    p.add_argument("--dtype", default="bf16", choices=sorted(BYTES))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8: grouped-query, as Llama 3 8B)")
    p.add_argument("--links", default=",".join(LINKS), help="name or name=GB/s per direction, comma-separated")
    p.add_argument("--latency-us", type=float, default=10.0, help="fixed cost of one step's transfer (default 10)")
    p.add_argument("--ranks", default="2,4,8,16,32,64")
    p.add_argument("--seqlens", default="32768,131072,1048576", help="whole sequence lengths N")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="h100_ring_model", help="file stem of the CSV and PNG")
    args = p.parse_args(argv)
    thr = read_throughput(args.csv, args.impl, args.head_dim)
    shape = Shape(args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
    links = _links(args.links)
    rows = table(thr, shape, links, [int(w) for w in args.ranks.split(",")], [int(n) for n in args.seqlens.split(",")],
                 args.latency_us)  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in asdict(row).items()})
    plot(thr, shape, links, rows, args.latency_us, out / f"{args.name}.png")
    print(f"from {thr.source} ({args.impl}, D={args.head_dim}), H={args.heads} Hkv={args.kv_heads}, {args.dtype}")
    print("link          GB/s  n* fwd  n* bwd  (causal zigzag; non-causal: fwd, bwd)")
    for link, gbps in links.items():
        cross = [crossover(thr, shape, c, m, gbps, args.latency_us) for c in (True, False) for m in ("fwd", "bwd")]
        print(f"{link:12s} {gbps:6g} {cross[0]:7d} {cross[1]:7d}  ({cross[2]}, {cross[3]})")
    print(f"wrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
