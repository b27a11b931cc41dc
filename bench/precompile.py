"""Compile every candidate config of the Triton kernels in parallel processes, before a timing run.

The autotuner compiles each candidate on first use, one after the other: about 100 compilations of 3-13 s each
for the grid of ``bench/h100.sh`` (measured on the device for float32; most of a 10-minute call). Triton keeps
compiled kernels in its on-disk cache, so compiling them here first, on all CPU cores, lets the timing run find
them there. Kernels are specialised on dtype, head dim, causal, seqlens_k and on integer arguments being 1 or
divisible by 16, not on the sizes, so two small problems per (dtype, D, causal) cover the grid: B = 1 (the grid's
N = 16k) and B = 2, with H = 16 and N = 256 (as divisible by 16 as the grid's H and N).

    PYTHONPATH=$PWD python3 bench/precompile.py --dtype fp16,bf16 --d 64,128 --workers 12
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnzoo.kernels.tuning import KernelConfig

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
DEVICE = "cuda"

# (dtype name, head dim, causal, kernel, config): one compilation of ``kernel`` with ``config``, the other kernels
# keeping their first candidate. atomic compiles both Delta variants.
Job = tuple[str, int, bool, str, "KernelConfig"]


def _jobs(dtypes: list[str], head_dims: list[int]) -> list[Job]:
    """Every candidate of every kernel, for each (dtype, D, causal)."""
    import torch

    from attnzoo.kernels.tuning import CANDIDATES, candidates, head_dim_tile

    jobs = []
    for dtype in dtypes:
        for d in head_dims:
            for kernel in CANDIDATES:
                configs = candidates(kernel, head_dim_tile(d), getattr(torch, DTYPES[dtype]), torch.device(DEVICE))
                jobs += [(dtype, d, causal, kernel, cfg) for causal in (False, True) for cfg in configs]
    return jobs


def compile_config(job: Job) -> str:
    """Compile (by running once on small inputs) one kernel config; returns a report line (run in a worker)."""
    import torch

    import attnzoo
    from attnzoo.kernels.tuning import CANDIDATES, candidates, head_dim_tile

    dtype_name, d, causal, kernel, config = job
    dtype = getattr(torch, DTYPES[dtype_name])
    forced = {name: candidates(name, head_dim_tile(d), dtype, torch.device(DEVICE))[0] for name in CANDIDATES}
    forced[kernel] = config
    start = time.time()
    try:
        for batch in (1, 2):
            q, k, v, do = (torch.randn(batch, 16, 256, d, device=DEVICE, dtype=dtype) for _ in range(4))
            two_kernel = attnzoo.get("triton_2kernel", configs={n: forced[n] for n in ("forward", "dq", "dkdv")})
            o, lse = two_kernel.forward(q, k, v, causal=causal)
            if kernel in ("dkdv", "dq"):
                two_kernel.backward(do, q, k, v, o, lse, causal=causal)
            elif kernel == "atomic":
                for delta in ("preprocess", "recompute"):
                    atomic = attnzoo.get("triton_atomic", delta=delta, configs={"atomic": config})
                    atomic.backward(do, q, k, v, o, lse, causal=causal)
        torch.cuda.synchronize()
        outcome = "ok"
    except Exception as exc:  # reported; the timing run falls back past configs that fail to launch
        outcome = type(exc).__name__
    return f"{dtype_name} D={d} causal={causal} {kernel} {config}: {outcome} {time.time() - start:.1f} s"


def compile_all(jobs: list[Job], workers: int) -> Iterator[str]:
    """:func:`compile_config` for every job on ``workers`` processes; yields the report lines as jobs finish."""
    # spawn: each worker initialises CUDA itself (a forked CUDA context is unusable).
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(compile_config, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp16,bf16", help="comma list of fp16, bf16, fp32")
    parser.add_argument("--d", default="64,128", help="head dims, comma list")
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    jobs = _jobs(args.dtype.split(","), [int(x) for x in args.d.split(",")])
    start = time.time()
    for line in compile_all(jobs, args.workers):
        print(line, flush=True)
    print(f"{len(jobs)} compilations in {time.time() - start:.0f} s with {args.workers} workers", flush=True)


if __name__ == "__main__":
    main()
