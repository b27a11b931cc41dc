"""The decoding benchmark: attention of a few query rows over a long KV cache, dense and paged.

    python -m attnzoo.bench.decode --out bench/results/h100_decode.csv            # on the GPU
    python -m attnzoo.bench.decode --plot bench/results/h100_decode.csv           # the plot, from the CSV

Each point is one call of B sequences, H = 32 query heads over Hkv = 8 K/V heads, D = 128, Nq query rows, every
sequence's cache full (``cache`` keys, no append), non-causal (every key visible: for Nq = 1 that is the causal
call; for Nq = 4 causal would hide 6 of 4 * cache pairs).  Effective bandwidth is the bytes of K and V that must be
read, ``2 * B * Hkv * cache * D * 2``, over the median time (``triton.testing.do_bench``), against the copy ceiling
(3.0 TB/s on the H100, SPEC.md's anchors).

Each call is timed two ways (``--modes``): ``eager``, the Python call as written (host work included: an eager
``attention_with_kvcache`` reads ``cache_seqlens`` back once to check it, a synchronisation), and ``graph``, the
call captured once in a CUDA graph and replayed (how a serving loop runs a decode step: no host work, no checks), which
is the kernels' own time.

Timed in the same run: ``triton_splitk`` and ``triton_2kernel`` (no split; a paged cache gathered into a dense copy
first) through ``attnzoo.attention_with_kvcache``, and on the dense cache SDPA's flash and cuDNN backends and
FlexAttention (compiled; its decoding kernel serves Nq < 128).  The dense cache and the paged pool share one buffer
``[B, cache, Hkv, D]`` each for K and V: the dense call reads it as ``[B, Hkv, cache, D]`` through ``.transpose(1, 2)``,
the paged call as pages of 64 keys through a block table that shuffles them (a 128k x 64 point needs 34 GB once,
not twice).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

COPY_CEILING_GBPS = 3000.0  # SPEC.md, "Measured anchors": copy 3.0 TB/s on the H100
H, HKV, D, PAGE = 32, 8, 128, 64
MODES = ("eager", "graph")
FIELDS = ["impl", "mode", "B", "Nq", "cache", "layout", "ms", "GBps", "of_copy", "vs_sdpa_flash", "note"]


def _kv_bytes(batch: int, cache: int) -> int:
    return 2 * batch * HKV * cache * D * 2  # K and V, bfloat16


def _views(bufs, layout):
    """K and V as the dense call ``[B, Hkv, cache, D]`` or the paged call ``[pages, Hkv, PAGE, D]`` sees them."""
    if layout == "dense":
        return tuple(buf.transpose(1, 2) for buf in bufs)
    return tuple(buf.view(-1, PAGE, HKV, D).transpose(1, 2) for buf in bufs)


def _impls(q, bufs, table, lengths, layout):
    """name -> callable for one point; the peers on the dense layout only."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnzoo

    from . import impls as peers

    k, v = _views(bufs, layout)

    impls = {
        name: _zoo_call(attnzoo.get(name), q, bufs, table, lengths, layout)
        for name in ("triton_splitk", "triton_2kernel")
    }
    if layout == "dense":

        def sdpa(backend):
            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            return run

        impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        # Compiled once per shape, its recompile limit raised above the grid's 18 shapes: past Dynamo's default of 8,
        # flex_attention would run its unfused eager form (scores materialised), which is not the kernel compared.
        flex = peers._flex()
        impls["flex_decoding"] = lambda: flex(q, k, v, enable_gqa=True)
    return impls


def _zoo_call(backend, q, bufs, table, lengths, layout):
    import attnzoo

    k, v = _views(bufs, layout)
    table_arg = None if layout == "dense" else table
    return lambda: attnzoo.attention_with_kvcache(
        q, k, v, lengths, block_table=table_arg, causal=False, backend=backend
    )


def _as_graph(fn):
    """``fn`` captured in a CUDA graph (after one warm-up call on a side stream, as capture requires): the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_ms(fn, mode: str) -> float:
    import triton

    run = _as_graph(fn) if mode == "graph" else fn
    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


def run(
    batches,
    caches,
    nqs,
    layouts,
    out: Path,
    budget_s: float,
    only: set[str] | None = None,
    configs=None,
    modes=MODES,
) -> list[dict]:
    import attnzoo

    torch.manual_seed(0)
    rows: list[dict] = []
    start = time.perf_counter()
    for cache in caches:
        for batch in batches:
            bufs = [torch.empty(batch, cache, HKV, D, dtype=torch.bfloat16, device="cuda").normal_() for _ in "kv"]
            pages = batch * cache // PAGE
            table = torch.randperm(pages, device="cuda").view(batch, cache // PAGE).to(torch.int32)
            lengths = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
            for nq in nqs:
                q = torch.randn(batch, H, nq, D, dtype=torch.bfloat16, device="cuda")
                flash_ms: dict[str, float] = {}  # mode -> SDPA flash's time
                for layout in layouts:
                    impls = _impls(q, bufs, table, lengths, layout)
                    for text in configs or ():
                        block_n, warps, stages = (int(x) for x in text.split(","))
                        be = attnzoo.get("triton_splitk", block_n=block_n, num_warps=warps, num_stages=stages)
                        impls[f"triton_splitk[{text}]"] = _zoo_call(be, q, bufs, table, lengths, layout)
                    for name, fn in impls.items():
                        if only and name.split("[")[0] not in only:
                            continue
                        for mode in modes:
                            row = dict(impl=name, mode=mode, B=batch, Nq=nq, cache=cache, layout=layout, note="")
                            over = time.perf_counter() - start > budget_s
                            if over and name not in ("triton_splitk", "sdpa_flash"):
                                row["note"] = "skipped: time budget"
                            else:
                                try:
                                    ms = _time_ms(fn, mode)
                                    gbps = _kv_bytes(batch, cache) / ms / 1e6
                                    row.update(
                                        ms=f"{ms:.4f}", GBps=f"{gbps:.0f}", of_copy=f"{gbps / COPY_CEILING_GBPS:.3f}"
                                    )
                                    if name == "sdpa_flash":
                                        flash_ms[mode] = ms
                                except Exception as error:  # a peer that cannot run this shape: recorded, not fatal
                                    row["note"] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
                                    torch.cuda.synchronize()
                            rows.append(row)
                    del impls
                point = [r for r in rows if r["B"] == batch and r["Nq"] == nq and r["cache"] == cache]
                for row in point:
                    if row.get("ms") and row["mode"] in flash_ms:
                        row["vs_sdpa_flash"] = f"{flash_ms[row['mode']] / float(row['ms']):.2f}"
                _print_point(point)
            del bufs, table
            torch.cuda.empty_cache()
    _write(rows, out)
    return rows


def _print_point(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"B={r['B']:>3} Nq={r['Nq']} cache={r['cache']:>6} {r['layout']:<5} {r['impl']:<28} {r['mode']:<5} "
            f"{r.get('ms', '-'):>9} ms {r.get('GBps', '-'):>6} GB/s {r.get('of_copy', '-'):>6} of copy "
            f"x{r.get('vs_sdpa_flash', '-')} vs flash {r['note']}",
            flush=True,
        )


def _write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in FIELDS})


def plot(csv_path: Path, png: Path) -> None:
    """Fraction of the copy ceiling per point, one panel per (timing mode, Nq, layout), one line per
    implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(csv_path.open()) if r["ms"]]
    for r in rows:
        r.setdefault("mode", "eager")  # CSVs from before the graph mode timed eager calls only
    panels = sorted({(r["mode"], int(r["Nq"]), r["layout"]) for r in rows})
    columns = len({p[1:] for p in panels})
    fig, axes = plt.subplots(
        len(panels) // columns, columns, figsize=(5 * columns, 4.2 * len(panels) // columns), sharey=True, squeeze=False
    )
    points = sorted({(int(r["cache"]), int(r["B"])) for r in rows})
    labels = [f"{c // 1024}k\nB={b}" for c, b in points]
    impls = sorted({r["impl"] for r in rows if "[" not in r["impl"]})
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per implementation in every panel
    for ax, (mode, nq, layout) in zip(axes.flat, panels, strict=True):
        for impl in impls:
            here = [r for r in rows if (r["impl"], r["mode"], int(r["Nq"]), r["layout"]) == (impl, mode, nq, layout)]
            got = {(int(r["cache"]), int(r["B"])): float(r["of_copy"]) for r in here}
            if got:
                xs = [i for i, p in enumerate(points) if p in got]
                ax.plot(xs, [got[points[i]] for i in xs], marker="o", label=impl, color=colors[impl])
        ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(points)), labels, fontsize=7)
        ax.set_title(f"{mode}: Nq={nq}, {layout} cache" + (f" (page {PAGE})" if layout == "paged" else ""))
        ax.set_ylim(0, 1.05)
    for row_axes in axes:
        row_axes[0].set_ylabel("K+V bytes / time, fraction of 3.0 TB/s")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines() if not h.get_label().startswith("_")}
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.suptitle("Decoding, bf16, H=32, Hkv=8, D=128 (H100)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnzoo.bench.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/h100_decode.csv"))
    parser.add_argument("--plot", type=Path, help="draw the PNG from this CSV (no GPU needed) and exit")
    parser.add_argument("--B", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--cache", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--Nq", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layouts", nargs="+", default=["dense", "paged"], choices=["dense", "paged"])
    parser.add_argument("--only", nargs="+", help="time only these implementations")
    parser.add_argument("--configs", nargs="+", help="extra triton_splitk launches to time, 'block_n,warps,stages'")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="eager calls, graph replays")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="after this, time only splitk and flash")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, args.plot.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("error: the decoding benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    run(
        args.B, args.cache, args.Nq, args.layouts, args.out, args.budget_s, set(args.only or ()), args.configs,
        tuple(args.modes),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
