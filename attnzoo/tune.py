"""``python -m attnzoo tune``: time the Triton kernels' candidate configs for some shapes and store the winners.

Without tuning, a call runs the config stored for its key (the user's disk cache, or the table shipped for the GPU
model) or else a heuristic pick; nothing is timed (see :mod:`attnzoo.kernels.tuning`).  This command times the
candidates once, ahead of time, and writes the winners to the disk cache that every later process reads:

1. it compiles every candidate config of every kernel for the requested dtypes and head dims in parallel worker
   processes (compilation is CPU work: 2-13 s per config on the H100 machine; Triton keeps the compiled kernels in
   its on-disk cache, where step 2 finds them);
2. it runs forward and backward of ``triton_2kernel`` and ``triton_atomic`` for each (dtype, D, N, causal) inside
   :func:`attnzoo.kernels.tuning.autotuning`, which times every candidate per key and stores the winner.

``--layout packed`` (or ``both``) tunes the packed kernels of ``attention_varlen``: their keys are their own
(``varlen``), and a packed batch's best tile is not always the dense one's (bench/results/h100_varlen_tuning.log).
The packed case is ``attnzoo.bench.varlen``'s: 16k tokens in sequences of lengths drawn uniformly from
``[128, N]`` (seed 0), so that the longest falls in N's bucket.

    python -m attnzoo tune --dtype fp16,bf16 --d 64,128 --N 1k,2k,4k,8k,16k
    python -m attnzoo tune --dtype bf16 --d 128 --N 4k --layout packed
    python -m attnzoo tune --kernels dq        # the dQ kernel's keys only (say, after new candidates)

``--window L,R`` and ``--softcap C`` tune the keys of calls with that sliding window or soft cap (SPEC.md's
semantics): their keys are their own (a window's by the power-of-two bucket of its band's span), and so are their
best tiles (bench/results/h100_modifiers_window_span.log, h100_softcap_tuning.log).

    python -m attnzoo tune --dtype bf16 --d 128 --N 4k,16k --causal yes --window 4095,0
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


def _jobs(
    dtypes: list[str], head_dims: list[int], causals: list[bool], layouts: list[int | None], modifiers: tuple = ()
) -> list[tuple]:
    """(dtype name, D, causal, kernel, config text, layout, modifiers): one compilation each, every candidate of every
    kernel for each layout (None: dense; N: the packed case of N); ``modifiers``: the calls' keyword arguments as
    (name, value) pairs."""
    import torch

    from .kernels.tuning import CANDIDATES, candidates, head_dim_tile

    device = torch.device("cuda")
    return [
        (dtype, d, causal, kernel, str(cfg), packed_n, modifiers)
        for packed_n in layouts
        for dtype in dtypes
        for d in head_dims
        for kernel in CANDIDATES
        for cfg in candidates(kernel, head_dim_tile(d), getattr(torch, DTYPES[dtype]), device)
        for causal in causals
    ]


def packed_case(dtype: torch.dtype, d: int, n: int, seed: int = 0):
    """The packed batch that tunes the keys of longest sequence ``n``: 16k tokens, ``2048 // d`` heads, lengths drawn
    uniformly from ``[min(128, n), n]`` -> ``(q, k, v, do, cu_seqlens, max_seqlen)`` (q, k, v, do ``[16384, H, d]``)."""
    import torch

    from .bench.varlen import draw_lengths
    from .testing_varlen import cu_seqlens

    lengths, _ = draw_lengths(16384, min(128, n), n, seed)
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    shape = (16384, max(1, 2048 // d), d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    return q, k, v, do, cu_seqlens(lengths, "cuda"), max(lengths)


def _run_both_ways(
    backend, q, k, v, do, causal: bool, packed: tuple | None, backward: bool = True, modifiers: tuple = ()
) -> None:
    """One forward (and with ``backward`` one backward) of ``backend``: dense on ``[B, H, N, D]`` q, k, v, do, or
    (``packed = (cu_seqlens, max_seqlen)``) packed on ``[total, H, D]`` ones; ``modifiers``: (name, value) pairs of
    ``window`` and ``softcap``."""
    kwargs = dict(modifiers)
    if packed is None:
        o, lse = backend.forward(q, k, v, causal=causal, **kwargs)
        if backward:
            backend.backward(do, q, k, v, o, lse, causal=causal, **kwargs)
        return
    from .varlen import run_varlen_backward, run_varlen_forward, validate_varlen

    cu, max_len = packed
    problem = validate_varlen(q, k, v, cu, cu, max_len, max_len, causal, **kwargs)
    o, lse = run_varlen_forward(backend, q, k, v, problem)
    if backward:
        run_varlen_backward(backend, do, q, k, v, o, lse, problem)


def compile_config(job: tuple) -> str:
    """Compile one kernel config by running it once (in a worker process); one report line.  Dense jobs run small
    inputs, packed ones the packed case that the timing step runs (the same integer specialisations)."""
    import torch

    import attnzoo

    dtype_name, d, causal, kernel, config, packed_n, modifiers = job
    dtype = getattr(torch, DTYPES[dtype_name])
    start = time.perf_counter()
    try:
        if packed_n is None:
            inputs = []
            for batch in (1, 2):
                shape = (batch, _COMPILE_SHAPE["heads"], _COMPILE_SHAPE["seqlen"], d)
                inputs.append((tuple(torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4)), None))
        else:
            q, k, v, do, cu, max_len = packed_case(dtype, d, packed_n)
            inputs = [((q, k, v, do), (cu, max_len))]
        for tensors, packed in inputs:
            q, k, v, do = tensors
            if kernel == "atomic":
                for delta in ("preprocess", "recompute"):
                    atomic = attnzoo.get("triton_atomic", delta=delta, configs={"atomic": config})
                    _run_both_ways(atomic, q, k, v, do, causal, packed, modifiers=modifiers)
                continue
            backend = attnzoo.get("triton_2kernel", configs={kernel: config})
            # A forward config needs no backward (which would compile the backward kernels' picks in every job).
            _run_both_ways(backend, q, k, v, do, causal, packed, backward=kernel != "forward", modifiers=modifiers)
        torch.cuda.synchronize()
        outcome = "ok"
    except Exception as error:  # reported: the timing step falls back past configs that do not launch
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    label = f"{dtype_name} D={d} causal={causal}" + ("" if packed_n is None else f" packed N<={packed_n}")
    return f"{label} {kernel} {config}: {outcome} ({time.perf_counter() - start:.1f} s)"


def compile_all(jobs: list[tuple], workers: int, quiet: bool = False) -> None:
    """:func:`compile_config` for every job on ``workers`` spawned processes (a forked CUDA context is unusable)."""
    from .bench.progress import Progress

    progress = Progress(len(jobs), enabled=not quiet)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(compile_config, jobs):
            label, _, outcome = line.partition(": ")
            progress.advance(label, outcome)


def tune(
    dtypes: list[str],
    head_dims: list[int],
    lengths: list[int],
    causals: list[bool],
    quiet: bool,
    layouts: tuple[bool, ...] = (False,),
    kernels: tuple[str, ...] | None = None,
    modifiers: tuple = (),
) -> list[str]:
    """Time every key of the given shapes, dense and/or packed (``layouts``: False dense, True packed), and store the
    winners; returns one report line per key tuned.  ``kernels``: time only these kernels' keys (the backends that
    run none of them are not run); ``modifiers``: the calls' ``window``/``softcap`` as (name, value) pairs."""
    import torch

    import attnzoo

    from .bench.progress import Progress
    from .kernels.tuning import autotuning, tuned_report

    shapes = [
        (dtype, d, n, causal, packed)
        for packed in layouts
        for dtype in dtypes
        for d in head_dims
        for n in lengths
        for causal in causals
    ]
    backends = [name for name in BACKENDS if kernels is None or set(kernels) & set(attnzoo.get(name).kernel_names)]
    progress = Progress(len(shapes), enabled=not quiet)
    with autotuning(True, kernels):
        for dtype_name, d, n, causal, packed in shapes:
            dtype = getattr(torch, DTYPES[dtype_name])
            if packed:
                q, k, v, do, cu, max_len = packed_case(dtype, d, n)
                layout = (cu, max_len)
            else:
                # The benchmark's shapes: 16k tokens and model width 2048 (SPEC.md's anchors).
                batch, heads = max(1, 16384 // n), max(1, 2048 // d)
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                shape = (batch, heads, n, d)
                q, k, v, do = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
                layout = None
            for name in backends:
                _run_both_ways(attnzoo.get(name), q, k, v, do, causal, layout, modifiers=modifiers)
            torch.cuda.synchronize()
            progress.advance(f"{dtype_name} D={d} N={n} causal={causal}{' packed' if packed else ''}", "tuned")
    return list(tuned_report().values())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m attnzoo tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp16,bf16", help="comma list of fp16, bf16, fp32 (default fp16,bf16)")
    p.add_argument("--d", default="64,128", help="head dims, comma list (default 64,128)")
    p.add_argument("--N", default="1k,2k,4k,8k,16k", help="sequence lengths, comma list; 2k = 2048")
    p.add_argument("--causal", default="both", choices=["yes", "no", "both"], help="masks to tune (default both)")
    p.add_argument(
        "--layout", default="dense", choices=["dense", "packed", "both"],
        help="dense batches, packed ones (attention_varlen), or both (default dense)",
    )  # fmt: skip
    p.add_argument(
        "--kernels", default=None,
        help="comma list of the kernels to time (forward, dq, dkdv, atomic; default all): the others run their stored "
        "or shipped configs, untimed",
    )  # fmt: skip
    p.add_argument(
        "--window", default=None, metavar="LEFT,RIGHT",
        help="tune calls with this sliding window (SPEC.md: ints or 'none'; e.g. 4095,0 with --causal yes)",
    )  # fmt: skip
    p.add_argument("--softcap", type=float, default=0.0, help="tune calls with this soft cap (> 0; default none)")
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
    known = ("forward", "dq", "dkdv", "atomic")
    args.kernel_names = None if args.kernels is None else tuple(args.kernels.split(","))
    if args.kernel_names is not None and not set(args.kernel_names) <= set(known):
        p.error(f"--kernels: comma list of {', '.join(known)}, got {args.kernels!r}")
    args.causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    args.packed_layouts = {"dense": (False,), "packed": (True,), "both": (False, True)}[args.layout]
    modifiers = []
    if args.window is not None:
        from .compare import parse_window

        try:
            window = parse_window(args.window)
        except argparse.ArgumentTypeError as error:
            p.error(f"--window: {error}")
        if window == (None, None):
            p.error("--window: none,none is no window (leave --window out)")
        modifiers.append(("window", window))
    if args.softcap != 0.0:
        from .validation import _validate_softcap

        try:
            modifiers.append(("softcap", _validate_softcap(args.softcap)))
        except ValueError as error:
            p.error(f"--softcap: {error}")
    args.modifiers = tuple(modifiers)
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
        # Dense kernels compile once for every N; packed ones on each N's own packed case.
        layouts = [None] * (False in args.packed_layouts) + args.lengths * (True in args.packed_layouts)
        jobs = _jobs(args.dtypes, args.head_dims, args.causals, layouts, args.modifiers)
        jobs = [job for job in jobs if args.kernel_names is None or job[3] in args.kernel_names]
        compile_all(jobs, workers, args.quiet)
    if not args.compile_only:
        for line in tune(
            args.dtypes,
            args.head_dims,
            args.lengths,
            args.causals,
            args.quiet,
            args.packed_layouts,
            args.kernel_names,
            args.modifiers,
        ):
            print(f"[tuned] {line}")  # the lines bench/ship_tuning.py reads
        print(f"winners stored in {cache_file(current_identity())}")
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
