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

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _jobs(dtypes: list[str], head_dims: list[int]) -> list[tuple[str, int, bool, str, int]]:
    """(dtype, D, causal, kernel, candidate index): one compilation each (dq and dkdv also compile the Delta
    preprocess; atomic compiles both Delta variants)."""
    import torch

    from attnzoo.kernels.tuning import CANDIDATES, candidates

    jobs = []
    for dtype in dtypes:
        for d in head_dims:
            block_d = max(16, 1 << (d - 1).bit_length())
            for kernel in CANDIDATES:
                count = len(candidates(kernel, block_d, getattr(torch, DTYPES[dtype]), torch.device("cuda")))
                jobs += [(dtype, d, causal, kernel, i) for causal in (False, True) for i in range(count)]
    return jobs


def _compile(job: tuple[str, int, bool, str, int]) -> str:
    import torch

    import attnzoo
    from attnzoo.backends.triton_2kernel import make_context
    from attnzoo.kernels.backward_2kernel import attention_backward_2kernel
    from attnzoo.kernels.backward_atomic import attention_backward_atomic
    from attnzoo.kernels.forward import attention_forward
    from attnzoo.kernels.tuning import CANDIDATES, candidates

    dtype_name, d, causal, kernel, index = job
    dtype = getattr(torch, DTYPES[dtype_name])
    block_d = max(16, 1 << (d - 1).bit_length())
    lists = {name: candidates(name, block_d, dtype, torch.device("cuda")) for name in CANDIDATES}
    forced = {name: configs[0] for name, configs in lists.items()}
    forced[kernel] = lists[kernel][index]
    start = time.time()
    try:
        for batch in (1, 2):
            q, k, v, do = (torch.randn(batch, 16, 256, d, device="cuda", dtype=dtype) for _ in range(4))
            problem = attnzoo.get("triton_2kernel")._validate(q, k, v, causal, None, None)
            ctx = make_context(q, k, v, problem, None, forced_config=forced)
            o, lse = attention_forward(ctx)
            if kernel in ("dkdv", "dq"):
                attention_backward_2kernel(ctx, do, o, lse)
            elif kernel == "atomic":
                for delta in ("preprocess", "recompute"):
                    attention_backward_atomic(ctx, do, o, lse, delta)
        torch.cuda.synchronize()
        outcome = "ok"
    except Exception as exc:  # reported; the timing run falls back past configs that fail to launch
        outcome = type(exc).__name__
    return f"{dtype_name} D={d} causal={causal} {kernel} {forced[kernel]}: {outcome} {time.time() - start:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp16,bf16", help="comma list of fp16, bf16, fp32")
    parser.add_argument("--d", default="64,128", help="head dims, comma list")
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    jobs = _jobs(args.dtype.split(","), [int(x) for x in args.d.split(",")])
    start = time.time()
    # spawn: each worker initialises CUDA itself (a forked CUDA context is unusable).
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for line in pool.imap_unordered(_compile, jobs):
            print(line, flush=True)
    print(f"{len(jobs)} compilations in {time.time() - start:.0f} s with {args.workers} workers", flush=True)


if __name__ == "__main__":
    main()
