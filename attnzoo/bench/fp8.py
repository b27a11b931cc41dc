"""``python -m attnzoo.bench.fp8``: the FP8 forward (``attnzoo.attention_fp8``) beside the bfloat16 one, in one run.

The case (issue 28): D = 128, ``B = tokens / N`` (16k tokens), H = 16, N = 4k-16k, causal or not.  Per point:

- ``fp8``: ``attention_fp8`` on ``triton_2kernel`` with per-(batch, K/V head) factors and v stored keys-contiguous
  (what the kernel reads; a v with its head dim contiguous costs one copy more, timed as ``fp8_v_copy``);
- ``bf16``: ``triton_2kernel``'s forward on the real inputs in bfloat16 (its tuned configs: Gluon on Hopper);
- ``sdpa_cudnn``, ``sdpa_flash``: PyTorch's SDPA on the bfloat16 inputs, as yardsticks.

TFLOP/s count ``4 * B * H * N^2 * D`` (half when causal).  Times are ``triton.testing.do_bench`` medians after
warm-up; with ``--autotune`` every key's candidates are timed first (the FP8 keys have no shipped winners).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
from pathlib import Path

import torch

COLUMNS = ["impl", "N", "causal", "batch", "heads", "d", "ms", "tflops", "vs_bf16", "error"]


def _time_ms(fn) -> float:
    import triton

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _impls(q, k, v, factors, real, causal: bool) -> dict:
    """The timed calls of one point: name -> a function of no arguments."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import attnzoo

    backend = attnzoo.get("triton_2kernel")
    v_keys = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # what the FP8 kernel reads

    def fp8(v_stored):
        return lambda: attnzoo.attention_fp8(q, k, v_stored, *factors, causal=causal, backend=backend)

    def torch_sdpa(kind):
        def call():
            with sdpa_kernel(kind):
                return sdpa(*real, is_causal=causal)

        return call

    return {
        "fp8": fp8(v_keys),
        "fp8_v_copy": fp8(v),
        "bf16": lambda: backend.forward(*real, causal=causal),
        "sdpa_cudnn": torch_sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": torch_sdpa(SDPBackend.FLASH_ATTENTION),
    }


def run(args: argparse.Namespace) -> list[dict]:
    from attnzoo.fp8 import FP8, dequantize, descale_table

    rows = []
    d, heads = args.d, args.heads
    for n in args.N:
        batch = max(1, args.tokens // n)
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = ((torch.randn(batch, heads, n, d, device="cuda", generator=gen) * 3).to(FP8) for _ in range(3))
        factors = [0.25 + torch.rand(batch, heads, device="cuda", generator=gen) for _ in range(3)]
        real = dequantize(q, k, v, descale_table(*factors, batch, heads, q.device), torch.bfloat16)
        for causal in (False, True):
            flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
            point = []
            for name, fn in _impls(q, k, v, factors, real, causal).items():
                error = ""
                try:
                    ms = _time_ms(fn)
                except Exception as exc:
                    ms, error = float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                point.append(dict(impl=name, N=n, causal=causal, batch=batch, heads=heads, d=d, ms=ms,
                                  tflops=flops / ms * 1e-9, error=error))  # fmt: skip
            bf16_ms = next(row["ms"] for row in point if row["impl"] == "bf16")
            for row in point:
                row["vs_bf16"] = bf16_ms / row["ms"]
                print(f"N={n} causal={causal:d} {row['impl']:12s} {row['ms']:.3f} ms {row['tflops']:6.0f} TFLOP/s "
                      f"{row['vs_bf16']:.2f}x bf16 {row['error']}", flush=True)  # fmt: skip
            rows += point
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """TFLOP/s against N per implementation, one panel per mask (full, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4), squeeze=False)
    for ax, causal in zip(axes[0], (False, True), strict=True):
        points = [r for r in rows if str(r["causal"]) == str(causal)]
        for impl in dict.fromkeys(r["impl"] for r in points):
            line = sorted((int(r["N"]), float(r["tflops"])) for r in points if r["impl"] == impl)
            ax.plot([n for n, _ in line], [t for _, t in line], "-o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("causal" if causal else "full", fontsize=9)
    axes[0][0].legend(fontsize=7)
    d = rows[0]["d"] if rows else ""
    fig.suptitle(f"FP8 (e4m3) forward beside bfloat16, D={d}, 16k tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m attnzoo.bench.fp8", description=__doc__.split("\n\n")[0])
    cli.add_argument("--N", type=lambda t: [int(x) for x in t.split(",")], default=[4096, 8192, 16384])
    cli.add_argument("--tokens", type=int, default=16384)
    cli.add_argument("--heads", type=int, default=16)
    cli.add_argument("--d", type=int, default=128)
    cli.add_argument("--out", type=Path, help="CSV to write")
    cli.add_argument("--autotune", action="store_true", help="time every candidate config of each key first")
    cli.add_argument("--plot", type=Path, help="PNG to write")
    cli.add_argument("--replot", type=Path, metavar="CSV", help="only draw --plot from a CSV this script wrote")
    args = cli.parse_args(argv)
    if args.replot:
        with open(args.replot, newline="") as f:
            plot(list(csv.DictReader(f)), args.plot or args.replot.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("python -m attnzoo.bench.fp8: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from attnzoo.kernels import tuning

    with tuning.autotuning(True) if args.autotune else contextlib.nullcontext():
        rows = run(args)
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        plot(rows, args.plot)
    for line in tuning.tuned_report().values():
        print(f"[tuned] {line}")
    for key, (cfg, source) in tuning.chosen_configs().items():
        print(f"[config] {key}: {cfg} ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
