"""Time triton_2kernel's backward with each launch config of one kernel while the other keeps the autotuner's choice.

One row per (case, kernel, config): dK/dV configs with the chosen dQ config, then the reverse, on SPEC.md's shapes
(B = 16384 / N, H = 2048 / D). ``EXTRA`` holds configs that are not autotuning candidates, to find new ones.

    PYTHONPATH=$PWD python3 bench/sweep_backward.py --N 8192 --cases 128:no,128:yes,64:no --out $OUT/sweep.csv
"""

from __future__ import annotations

import argparse
import csv
import time

import torch
import triton
from precompile import compile_all  # bench/precompile.py, beside this script

import attnzoo
from attnzoo.backends.triton_2kernel import make_context
from attnzoo.kernels.backward_2kernel import attention_backward_2kernel
from attnzoo.kernels.tuning import AUTOTUNER, CANDIDATES, KernelConfig

EXTRA = {
    "dkdv": [
        KernelConfig(32, 128, 4, 4),
        KernelConfig(32, 128, 8, 4),
        KernelConfig(64, 128, 8, 4),
        KernelConfig(64, 64, 4, 4),
        KernelConfig(16, 128, 4, 3),
        KernelConfig(64, 128, 4, 3),
    ],
    "dq": [
        KernelConfig(128, 64, 8, 4),
        KernelConfig(128, 32, 4, 4),
        KernelConfig(128, 32, 8, 4),
        KernelConfig(64, 64, 4, 4),
        KernelConfig(64, 128, 8, 3),
    ],
}
KERNELS = ("dkdv", "dq")


def _configs(kernel: str) -> list[KernelConfig]:
    return CANDIDATES[kernel] + [c for c in EXTRA[kernel] if c not in CANDIDATES[kernel]]


def _inputs(d: int, causal: bool, n: int, batch: int):
    heads = 2048 // d
    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
    return q, k, v, do, attnzoo.get("triton_2kernel")._validate(q, k, v, causal, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, default=8192)
    parser.add_argument("--cases", default="128:no,128:yes,64:no", help="D:causal, comma list")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--out", default="sweep_backward.csv")
    args = parser.parse_args()
    cases = [(int(d), c == "yes") for d, c in (item.split(":") for item in args.cases.split(","))]
    jobs = [("fp16", d, causal, kernel, cfg) for d, causal in cases for kernel in KERNELS for cfg in _configs(kernel)]
    start = time.time()
    failed = [line for line in compile_all(jobs, args.workers) if ": ok " not in line]
    print(f"compiled {len(jobs)} configs in {time.time() - start:.0f} s; failed: {failed}", flush=True)

    with open(args.out, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["D", "causal", "kernel", "block_m", "block_n", "num_warps", "num_stages", "bwd_ms", "tflops"])
        for d, causal in cases:
            q, k, v, do, problem = _inputs(d, causal, args.N, 16384 // args.N)
            flops = 2.5 * 4 * q.shape[0] * q.shape[1] * args.N**2 * d * (0.5 if causal else 1.0)
            backend = attnzoo.get("triton_2kernel")
            o, lse = backend.forward(q, k, v, causal=causal)
            backend.backward(do, q, k, v, o, lse, causal=causal)  # the autotuner's choice for this key
            chosen = {key[0]: cfg for key, cfg in AUTOTUNER.best.items() if key[1] == d and key[3] == causal}
            print(f"D={d} causal={causal}: autotuned {chosen}", flush=True)
            for kernel in KERNELS:
                for cfg in _configs(kernel):
                    forced = {name: chosen[name] for name in KERNELS} | {kernel: cfg}
                    ctx = make_context(q, k, v, problem, None, forced_config=forced)
                    try:
                        ms = triton.testing.do_bench(
                            lambda ctx=ctx, do=do, o=o, lse=lse: attention_backward_2kernel(ctx, do, o, lse),
                            return_mode="median",
                        )
                    except Exception as exc:  # a config that cannot launch here: reported, not timed
                        print(f"  {kernel} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    row = [d, causal, kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]
                    writer.writerow([*row, f"{ms:.4f}", f"{flops / ms / 1e9:.1f}"])
                    print(f"  {kernel} {cfg}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
