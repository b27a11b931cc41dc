"""Quick timing of the Triton backends against torch SDPA (flash = FA2, and cuDNN) on one GPU.

    PYTHONPATH=$PWD python3 bench/quick_triton.py --out $OUT/quick.csv [--dtypes fp16,bf16] [--dims 64,128]
        [--seqlens 1024,2048,4096,8192,16384] [--causal 0,1] [--impls triton_2kernel,atomic_pre,...]

Shapes as in SPEC.md's anchors: B = 16384 / N, H = 2048 / D.  TFLOP/s = 4*B*H*N^2*D (half when causal) for the
forward and 2.5x that for the backward (timed alone, from saved o/lse; SDPA's backward through autograd).
Times are medians of ``triton.testing.do_bench`` after warm-up (the first call also autotunes).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnzoo
from attnzoo.backends.triton_atomic import variant
from attnzoo.bench.schema import forward_flops as flops

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def bench(fn) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def attnzoo_timings(backend, q, k, v, do, causal):
    o, lse = backend.forward(q, k, v, causal=causal)  # warm-up and autotune
    backend.backward(do, q, k, v, o, lse, causal=causal)
    fwd = bench(lambda: backend.forward(q, k, v, causal=causal))
    bwd = bench(lambda: backend.backward(do, q, k, v, o, lse, causal=causal))
    return fwd, bwd


def sdpa_timings(kind, q, k, v, do, causal):
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[kind]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        bwd = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    return fwd, bwd


def overhead_report(impl: str, fn, calls: int = 50) -> str:
    """Eager do_bench median vs CUDA-graph replay median (no host work), and host issue time per call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    eager = bench(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    replay = bench(graph.replay)
    return f"{impl}: eager {eager:.3f} ms, graph replay {replay:.3f} ms, host issue {host_us:.0f} us/call"


def print_overhead(be, q, k, v, do, causal: bool, D: int, N: int) -> None:
    """Host overhead of the forward and backward of ``be``, and the autotuner's timings for this shape."""
    from attnzoo.kernels.tuning import AUTOTUNER

    print(overhead_report("fwd", lambda: be.forward(q, k, v, causal=causal)))
    o, lse = be.forward(q, k, v, causal=causal)
    print(overhead_report("bwd", lambda: be.backward(do, q, k, v, o, lse, causal=causal)))
    for key, timings in AUTOTUNER.timings.items():
        if key[1] == D and key[3] == causal and key[5] == triton.next_power_of_2(N):
            ranked = sorted(timings.items(), key=lambda x: x[1])
            cells = ", ".join(f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}:{t:.3f}" for c, t in ranked)
            print(f"  tuned {key[0]}: {cells}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="quick_triton.csv")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--impls", default="triton_2kernel,atomic_pre,atomic_rec,sdpa_flash,sdpa_cudnn")
    ap.add_argument("--overhead", action="store_true", help="also: eager vs CUDA-graph forward, host time, tuning")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    attn = {
        "triton_2kernel": attnzoo.get("triton_2kernel"),
        "atomic_pre": variant("preprocess"),
        "atomic_rec": variant("recompute"),
    }
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for dt in args.dtypes.split(","):
        for D in map(int, args.dims.split(",")):
            for N in map(int, args.seqlens.split(",")):
                for causal in (c == "1" for c in args.causal.split(",")):
                    B, H = max(1, 16384 // N), max(1, 2048 // D)
                    g = torch.Generator(device="cuda").manual_seed(N + D)
                    q, k, v, do = (
                        torch.randn(B, H, N, D, device="cuda", dtype=DTYPES[dt], generator=g) for _ in range(4)
                    )
                    for impl in impls:
                        t0 = time.time()
                        try:
                            if impl in attn:
                                fwd, bwd = attnzoo_timings(attn[impl], q, k, v, do, causal)
                            else:
                                fwd, bwd = sdpa_timings(impl, q, k, v, do, causal)
                        except Exception as exc:  # report and go on (e.g. a backend not built for this shape)
                            print(f"{impl} {dt} D={D} N={N} causal={causal}: {type(exc).__name__}: {exc}")
                            continue
                        f = flops(B, H, N, D, causal)
                        row = dict(
                            impl=impl, dtype=dt, D=D, N=N, B=B, H=H, causal=int(causal),
                            fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                            fwd_tflops=round(f / fwd / 1e9, 1), bwd_tflops=round(2.5 * f / bwd / 1e9, 1),
                            wall_s=round(time.time() - t0, 1),
                        )  # fmt: skip
                        rows.append(row)
                        print(row, flush=True)
                        if args.overhead and impl == "triton_2kernel":
                            print_overhead(attn[impl], q, k, v, do, causal, D, N)
                        with open(args.out, "a" if len(rows) > 1 else "w", newline="") as fh:  # survive a kill
                            writer = csv.DictWriter(fh, fieldnames=list(row))
                            if len(rows) == 1:
                                writer.writeheader()
                            writer.writerow(row)
    # Short table last: TFLOP/s fwd/bwd per shape and implementation.
    print("\n" + "dtype D N causal | " + " | ".join(f"{i} fwd/bwd" for i in impls))
    shapes = sorted({(r["dtype"], r["D"], r["N"], r["causal"]) for r in rows})
    for s in shapes:
        cells = []
        for impl in impls:
            r = next((r for r in rows if (r["dtype"], r["D"], r["N"], r["causal"]) == s and r["impl"] == impl), None)
            cells.append("-" if r is None else f"{r['fwd_tflops']:.0f}/{r['bwd_tflops']:.0f}")
        print(f"{s[0]} {s[1]} {s[2]} {s[3]} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
