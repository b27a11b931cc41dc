"""``python -m attnzoo tune``: time the Triton kernels' candidate configs for some shapes and store the winners.

Without tuning, a call runs the config stored for its key (the user's disk cache, or the table shipped for the GPU
model) or else a heuristic pick; nothing is timed (see :mod:`attnzoo.kernels.tuning`).  This command times the
candidates once, ahead of time, and writes the winners to the disk cache that every later process reads:

1. it compiles every candidate config of every kernel for the requested dtypes and head dims in parallel worker
   processes (compilation is CPU work: 2-13 s per config on the H100 machine; Triton keeps the compiled kernels in
   its on-disk cache, where step 2 finds them);
2. it runs forward and backward of ``triton_2kernel`` and ``triton_atomic`` for each (dtype, D, N, causal) inside
   :func:`attnzoo.kernels.tuning.autotuning`, which times every candidate per key and stores the winner.

    python -m attnzoo tune --dtype fp16,bf16 --d 64,128 --N 1k,2k,4k,8k,16k
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
BACKENDS = ("triton_2kernel", "triton_atomic")
# Kernels are specialised on dtype, head dim, causal and on integer arguments being 1 or divisible by 16, not on the
# sizes: two small problems (B = 1 and 2) compile what every size of a (dtype, D, causal) needs.
_COMPILE_SHAPE = dict(heads=16, seqlen=256)


def _lengths(text: str) -> list[int]:
    """``"1k,4096"`` -> ``[1024, 4096]``."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        value = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        if value < 1:
            raise ValueError(f"sequence lengths must be positive, got {item!r}")
        out.append(value)
    return out


def _jobs(dtypes: list[str], head_dims: list[int], causals: list[bool]) -> list[tuple]:
    """(dtype name, D, causal, kernel, config text): one compilation each, every candidate of every kernel."""
    import torch

    from .kernels.tuning import CANDIDATES, candidates, head_dim_tile

    device = torch.device("cuda")
    return [
        (dtype, d, causal, kernel, str(cfg))
        for dtype in dtypes
        for d in head_dims
        for kernel in CANDIDATES
        for cfg in candidates(kernel, head_dim_tile(d), getattr(torch, DTYPES[dtype]), device)
        for causal in causals
    ]


def compile_config(job: tuple) -> str:
    """Compile one kernel config by running it once on small inputs (in a worker process); one report line."""
    import torch

    import attnzoo

    dtype_name, d, causal, kernel, config = job
    dtype = getattr(torch, DTYPES[dtype_name])
    start = time.perf_counter()
    try:
        for batch in (1, 2):
            shape = (batch, _COMPILE_SHAPE["heads"], _COMPILE_SHAPE["seqlen"], d)
            q, k, v, do = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
            if kernel == "atomic":
                for delta in ("preprocess", "recompute"):
                    atomic = attnzoo.get("triton_atomic", delta=delta, configs={"atomic": config})
                    atomic.backward(do, q, k, v, *atomic.forward(q, k, v, causal=causal), causal=causal)
                continue
            backend = attnzoo.get("triton_2kernel", configs={kernel: config})
            o, lse = backend.forward(q, k, v, causal=causal)
            if kernel != "forward":
                backend.backward(do, q, k, v, o, lse, causal=causal)
        torch.cuda.synchronize()
        outcome = "ok"
    except Exception as error:  # reported: the timing step falls back past configs that do not launch
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return f"{dtype_name} D={d} causal={causal} {kernel} {config}: {outcome} ({time.perf_counter() - start:.1f} s)"


def compile_all(jobs: list[tuple], workers: int, quiet: bool = False) -> None:
    """:func:`compile_config` for every job on ``workers`` spawned processes (a forked CUDA context is unusable)."""
    from .bench.progress import Progress

    progress = Progress(len(jobs), enabled=not quiet)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(compile_config, jobs):
            label, _, outcome = line.partition(": ")
            progress.advance(label, outcome)


def tune(dtypes: list[str], head_dims: list[int], lengths: list[int], causals: list[bool], quiet: bool) -> list[str]:
    """Time every key of the given shapes and store the winners; returns one report line per key tuned."""
    import torch

    import attnzoo

    from .bench.progress import Progress
    from .kernels.tuning import autotuning, tuned_report

    shapes = [(dtype, d, n, causal) for dtype in dtypes for d in head_dims for n in lengths for causal in causals]
    progress = Progress(len(shapes), enabled=not quiet)
    with autotuning(True):
        for dtype_name, d, n, causal in shapes:
            dtype = getattr(torch, DTYPES[dtype_name])
            # The benchmark's shapes: 16k tokens and model width 2048 (SPEC.md's anchors).
            batch, heads = max(1, 16384 // n), max(1, 2048 // d)
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
            for name in BACKENDS:
                backend = attnzoo.get(name)
                o, lse = backend.forward(q, k, v, causal=causal)
                backend.backward(do, q, k, v, o, lse, causal=causal)
            torch.cuda.synchronize()
            progress.advance(f"{dtype_name} D={d} N={n} causal={causal}", "tuned")
    return list(tuned_report().values())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m attnzoo tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp16,bf16", help="comma list of fp16, bf16, fp32 (default fp16,bf16)")
    p.add_argument("--d", default="64,128", help="head dims, comma list (default 64,128)")
    p.add_argument("--N", default="1k,2k,4k,8k,16k", help="sequence lengths, comma list; 2k = 2048")
    p.add_argument("--causal", default="both", choices=["yes", "no", "both"], help="masks to tune (default both)")
    p.add_argument("--workers", type=int, default=None, help="compilation processes (default: CPU count, at most 16)")
    p.add_argument("--skip-compile", action="store_true", help="no parallel compilation step")
    p.add_argument("--compile-only", action="store_true", help="only the parallel compilation step (no timing)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        args.dtypes = [name for name in args.dtype.split(",") if DTYPES[name]]
    except KeyError as error:
        p.error(f"--dtype: unknown {error.args[0]!r}; choose from {', '.join(DTYPES)}")
    try:
        args.head_dims = [int(x) for x in args.d.split(",")]
        args.lengths = _lengths(args.N)
    except ValueError as error:
        p.error(f"--d/--N: {error}")
    if any(d < 1 or d > 256 for d in args.head_dims):
        p.error(f"--d: head dims must lie in 1..256, got {args.d}")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    args.causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import os

    import torch

    if not torch.cuda.is_available():
        print("python -m attnzoo tune: no CUDA GPU (tuning times the kernels on the GPU)", file=sys.stderr)
        return 2
    from .kernels.tuning import cache_file, current_identity

    start = time.perf_counter()
    if not args.skip_compile:
        workers = args.workers or min(16, os.cpu_count() or 1)
        compile_all(_jobs(args.dtypes, args.head_dims, args.causals), workers, args.quiet)
    if not args.compile_only:
        for line in tune(args.dtypes, args.head_dims, args.lengths, args.causals, args.quiet):
            print(line)
        print(f"winners stored in {cache_file(current_identity())}")
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
