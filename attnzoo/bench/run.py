"""``python -m attnzoo bench``: time implementations over a grid of shapes and write one CSV row per case.

Shapes follow SPEC.md's fixed token budget unless ``--B``/``--H`` are given: ``B = tokens / N`` and
``H = width / D`` (16384 tokens and width 2048 on a GPU).  Every case gets fresh random inputs.  A case an impl
does not support is written as ``skipped: <reason>``, an out-of-memory case as ``oom``; neither stops the run.

Without CUDA the defaults shrink to a tiny float32 grid over the CPU-capable impls (timed with
``time.perf_counter``), so that CI exercises the tool itself.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import cli
from ..kernels import tuning
from ..testing import random_inputs
from . import impls as impl_registry
from . import timing
from .machine import machine_info, machine_tag
from .progress import Progress
from .schema import (
    STATUS_OK,
    STATUS_OOM,
    backward_flops,
    forward_flops,
    parse_lengths,
    status_kind,
    tflops,
    write_csv,
)

DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}

# Defaults per machine kind: (dtypes, head dims, sequence lengths, tokens, width, warmup, repeat, max_call_s)
GPU_DEFAULTS = dict(dtype="fp16,bf16", d="64,128", N="1024,2048,4096,8192,16384", tokens=16384, width=2048)
CPU_DEFAULTS = dict(dtype="fp32", d="32", N="64,128", tokens=128, width=64)
REFERENCE_IMPLS = {"speedup_vs_sdpa_flash": "sdpa_flash", "speedup_vs_sdpa_cudnn": "sdpa_cudnn"}


@dataclass(frozen=True)
class Case:
    """One row of the grid."""

    dtype: torch.dtype
    mode: str  # "fwd" or "train"
    impl: str  # an impl spec (see impls.py): what runs; the CSV names it impls.impl_label(impl)
    B: int
    H: int
    Hkv: int
    N: int
    D: int
    causal: bool
    seqlen_k: int  # keys visible per batch (N unless --seqlen-k-frac < 1, then passed as seqlens_k)

    @property
    def train(self) -> bool:
        return self.mode == "train"

    def label(self) -> str:
        causal, impl = "causal" if self.causal else "full", impl_registry.impl_label(self.impl)
        return f"{self.mode} {DTYPE_NAMES[self.dtype]} D={self.D} N={self.N} {causal} {impl}"

    def row(self) -> dict:
        return {
            "dtype": DTYPE_NAMES[self.dtype],
            "mode": self.mode,
            "impl": impl_registry.impl_label(self.impl),
            "B": self.B,
            "H": self.H,
            "Hkv": self.Hkv,
            "N": self.N,
            "D": self.D,
            "causal": self.causal,
            "seqlen_k": self.seqlen_k,
        }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _wants_cuda(argv: list[str]) -> bool:
    """Whether the run goes to the GPU: ``--device`` if given, else whether CUDA is available."""
    for i, arg in enumerate(argv):
        if arg.startswith("--device"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            return value == "cuda"
    return torch.cuda.is_available()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser(_wants_cuda(argv))
    args = p.parse_args(argv)
    _check(p, args)
    return args


def build_parser(cuda: bool) -> argparse.ArgumentParser:
    """The flags, with the defaults of a GPU run (``cuda``) or of a CPU run."""
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m attnzoo bench",
        description=__doc__.split("\n\n")[0],
        epilog="python -m attnzoo bench ab IMPL IMPL ... times implementations against each other on the same "
        "inputs in alternating rounds (bench ab --help).",
    )
    p.add_argument(
        "--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"], help="default: cuda when available"
    )
    p.add_argument("--mode", default="fwd,train", help="fwd, train, or both (comma list accepted)")
    p.add_argument("--dtype", default=defaults["dtype"], help="comma list of fp16, bf16, fp32, fp64")
    p.add_argument("--causal", default="both", choices=["yes", "no", "both"], help="bottom-right causal mask")
    p.add_argument("--d", default=defaults["d"], help="head dims, comma list")
    p.add_argument("--N", default=defaults["N"], help="sequence lengths, comma list (2k = 2048)")
    p.add_argument("--B", type=cli.positive_int, default=None, help="batch size (default: tokens / N)")
    p.add_argument("--H", type=cli.positive_int, default=None, help="query heads (default: width / D)")
    p.add_argument("--Hkv", type=cli.positive_int, default=None, help="K/V heads; H must be a multiple (default: H)")
    p.add_argument(
        "--tokens", type=cli.positive_int, default=defaults["tokens"], help="token budget B*N when --B is not given"
    )
    p.add_argument(
        "--width", type=cli.positive_int, default=defaults["width"], help="model width H*D when --H is not given"
    )
    p.add_argument(
        "--seqlen-k-frac",
        type=cli.finite_float,
        default=1.0,
        help="visible keys per batch as a fraction of N (<1: seqlens_k)",
    )
    p.add_argument(
        "--impl",
        default="all",
        help=f"comma list of impl specs or 'all'; known: {', '.join(impl_registry.impl_names())}; a backend's variant "
        "is name:key=value,... (e.g. triton_atomic:delta=recompute)",
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=5 if cuda else 1, help="untimed calls before timing")
    p.add_argument(
        "--repeat", type=cli.positive_int, default=20 if cuda else 3, help="timed calls (the median is kept)"
    )
    p.add_argument(
        "--warmup-ms",
        type=cli.nonnegative_float,
        default=100.0 if cuda else 0.0,
        help="untimed calls go on until they have run this long (the GPU's clocks settle after autotuning)",
    )
    p.add_argument(
        "--max-call-s",
        type=cli.nonnegative_float,
        default=1.0 if cuda else 10.0,
        help="a step (forward + backward) slower than this after compilation is recorded as skipped, and so are "
        "larger N of that impl: on a GPU this keeps the Python-loop references from eating the run's time",
    )
    p.add_argument(
        "--time-budget-s",
        type=cli.nonnegative_float,
        default=0,
        help="start no case after this many seconds (0: no limit)",
    )
    p.add_argument(
        "--recheck",
        type=cli.nonnegative_float,
        default=1.15 if cuda else 0.0,
        help="re-measure a shape (all its rows) once when forward times that cannot differ do, by more than this "
        "factor: one impl in fwd and train mode, or impls that run the same forward code; each row keeps the "
        "faster of its two measurements (0: off)",
    )
    p.add_argument("--out", default=None, help="CSV path (default bench/results/<machine>_bench.csv)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (each case draws its own)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--autotune",
        action="store_true",
        help="time every Triton kernel's candidates afresh for each key (and store the winners) instead of using the "
        "stored or shipped winners; the [tuned] lines of the log list the timings",
    )
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before any case runs: a bad one is a usage error (one line, exit 2)."""
    cli.check_device(p, args.device)
    try:
        if args.mode != "both":
            cli.pick_names(args.mode, ["fwd", "train"], "mode")
        cli.pick_names(args.dtype, DTYPES, "dtype")
        if args.impl != "all":
            specs = impl_registry.split_impl_list(args.impl)
            if not specs:
                raise ValueError(f"no impl named in {args.impl!r}")
            for spec in specs:
                name = impl_registry.parse_impl_spec(spec)[0]
                if name not in impl_registry.impl_names():
                    raise ValueError(cli.unknown_name("impl", name, impl_registry.impl_names()))
                impl_registry.get_impl(spec)  # a bad option of a known backend: its TypeError/ValueError
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    for flag, text in (("--d", args.d), ("--N", args.N)):
        try:
            values = _ints(text) if flag == "--d" else parse_lengths(text)
        except ValueError:
            p.error(f"{flag} must be a comma list of positive integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"{flag} must be a comma list of positive integers, got {text!r}")
    if not 0 < args.seqlen_k_frac <= 1:
        p.error(f"--seqlen-k-frac must lie in (0, 1], got {args.seqlen_k_frac:g}")
    for D in _ints(args.d):
        H = args.H or max(1, args.width // D)
        if args.Hkv and H % args.Hkv:
            p.error(f"H = {H} (at D = {D}) is not a multiple of --Hkv {args.Hkv}")


def build_grid(args: argparse.Namespace) -> list[Case]:
    """The cases in run order: grouped by (dtype, D, causal, mode), each impl over increasing N."""
    modes = ["fwd", "train"] if args.mode == "both" else [m for m in args.mode.split(",") if m]
    dtypes = [DTYPES[name] for name in args.dtype.split(",") if name]  # names checked by parse_args
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    if args.impl == "all":
        names = impl_registry.default_impls(args.device == "cuda")
    else:
        names = impl_registry.split_impl_list(args.impl)
    for name in names:
        impl_registry.get_impl(name)  # unknown names fail here, before any case runs
    cases = []
    for dtype in dtypes:
        for D in _ints(args.d):
            H = args.H or max(1, args.width // D)
            Hkv = args.Hkv or H
            for causal in causals:
                for mode in modes:
                    for name in names:
                        for N in sorted(parse_lengths(args.N)):
                            B = args.B or max(1, args.tokens // N)
                            seqlen_k = max(1, math.floor(args.seqlen_k_frac * N)) if args.seqlen_k_frac < 1 else N
                            cases.append(Case(dtype, mode, name, B, H, Hkv, N, D, causal, seqlen_k))
    return cases


def make_inputs(case: Case, device: torch.device, seed: int) -> impl_registry.Inputs:
    """Fresh standard-normal q, k, v, do for one case (never zeros), seeded by the case for reproducibility."""
    seqlens = [case.seqlen_k] * case.B if case.seqlen_k < case.N else None
    x = random_inputs(
        case.B, case.H, case.Hkv, case.N, case.N, case.D, dtype=case.dtype, device=device,
        seed=zlib.crc32(f"{seed}:{case}".encode()), seqlens_k=seqlens, with_do=case.train,
    )  # fmt: skip
    return impl_registry.Inputs(x.q, x.k, x.v, x.do, case.causal, x.seqlens_k)


class TooSlowError(Exception):
    """One step took longer than --max-call-s."""


def measure(case: Case, impl: impl_registry.Impl, inputs: impl_registry.Inputs, args, baseline: int) -> dict:
    """Time one supported case: forward (and backward alone in train mode), and its peak memory."""
    device = inputs.device
    prepared = impl.prepare(inputs, case.train)
    prepared.step()  # first call: compilation, autotuning, handle creation; never timed, never in the peak
    timing.synchronize(device)
    timing.reset_peak(device)  # the window's peak starts at what is allocated now; baseline predates the inputs
    seconds = timing.wall_seconds(prepared.step, device)
    peak_mb = timing.peak_mb_since(device, baseline)
    if seconds > args.max_call_s:
        raise TooSlowError(f"one step took {seconds:.1f} s > --max-call-s {args.max_call_s:g}")
    fwd_ms = timing.median_ms(prepared.forward, device, args.warmup, args.repeat, args.warmup_ms)
    bwd_ms = None
    if case.train:
        backward = prepared.make_backward()
        bwd_ms = timing.median_ms(backward, device, args.warmup, args.repeat, args.warmup_ms)
        del backward
    total_ms = fwd_ms + (bwd_ms or 0.0)
    shape = (case.B, case.H, case.N, case.D, case.causal, case.seqlen_k)
    return {
        "fwd_ms": fwd_ms,
        "bwd_ms": bwd_ms,
        "total_ms": total_ms,  # train: forward + backward, each timed alone
        "tflops_fwd": tflops(forward_flops(*shape), fwd_ms),
        "tflops_bwd": tflops(backward_flops(*shape), bwd_ms),
        "tokens_per_s": case.B * case.N / (total_ms * 1e-3),
        "peak_mem_mb": peak_mb,
        "skip_ratio": impl.skip_ratio(inputs),
        "status": STATUS_OK,
    }


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower()


def _is_unsupported(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, NotImplementedError) or "No available kernel" in text or "No viable backend" in text


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def run_case(case: Case, args, device: torch.device) -> dict:
    """One case's measured columns and status; never raises for unsupported, out-of-memory or failing cases."""
    impl = impl_registry.get_impl(case.impl)
    baseline = timing.reset_peak(device)
    inputs = None
    try:
        inputs = make_inputs(case, device, args.seed)
        reasons = impl.reasons(inputs)
        if reasons:
            return {"status": "skipped: " + "; ".join(reasons)}
        return measure(case, impl, inputs, args, baseline)
    except TooSlowError as error:
        return {"status": f"skipped: too slow ({error})"}
    except Exception as error:  # a benchmark row records what happened instead of stopping the grid
        if _is_oom(error):
            return {"status": STATUS_OOM}
        if _is_unsupported(error):
            return {"status": "skipped: " + _first_line(error)}
        return {"status": f"error: {type(error).__name__}: {_first_line(error)}"}
    finally:
        del inputs
        timing.release_memory(device)


# The columns that say which problem a row timed (its impl and mode aside).
SHAPE_COLUMNS = ("dtype", "B", "H", "Hkv", "N", "D", "causal", "seqlen_k")


def fill_speedups(rows: list[dict]) -> None:
    """speedup_vs_X = time of X / time of the row, for the same case measured in the same run (total_ms)."""

    def key(row):
        return (row["mode"], *(row[c] for c in SHAPE_COLUMNS))

    for column, ref_impl in REFERENCE_IMPLS.items():
        refs = {key(r): r["total_ms"] for r in rows if r["impl"] == ref_impl and r["status"] == STATUS_OK}
        for row in rows:
            ref = refs.get(key(row))
            if row["status"] == STATUS_OK and ref:
                row[column] = ref / row["total_ms"]


def inconsistent_shapes(rows: list[dict], factor: float, forward_code: dict[str, object]) -> list[tuple]:
    """Shapes (``SHAPE_COLUMNS`` values) whose forward times disagree by more than ``factor`` where they cannot.

    One impl's forward is the same call in ``fwd`` and ``train`` mode, and impls with the same ``forward_code``
    (e.g. triton_2kernel and triton_atomic) run the same kernel: a larger gap there is a stretch of slow runs
    (on the H100 grids of 2026-11-22: 8 shapes in 40, up to 5x), not a property of the impl.
    """
    times: dict[tuple, dict[tuple[str, str], float]] = {}
    for row in rows:
        if row["status"] == STATUS_OK:
            times.setdefault(tuple(row[c] for c in SHAPE_COLUMNS), {})[(row["mode"], row["impl"])] = row["fwd_ms"]

    def apart(a: float, b: float) -> bool:
        return max(a, b) > factor * min(a, b)

    def same_code(a: str, b: str) -> bool:
        return forward_code.get(a) is not None and forward_code.get(a) == forward_code.get(b)

    flagged = []
    for shape, fwd in times.items():
        same_call = [(("fwd", impl), ("train", impl)) for mode, impl in fwd if mode == "fwd"]
        same_kernel = [(x, y) for x, y in itertools.combinations(fwd, 2) if x[0] == y[0] and same_code(x[1], y[1])]
        if any(x in fwd and y in fwd and apart(fwd[x], fwd[y]) for x, y in same_call + same_kernel):
            flagged.append(shape)
    return flagged


def faster_of(first: dict, second: dict) -> dict:
    """Of two measurements of one case, the one with the lower total time (a measured one over a failed one).

    A slow stretch can fall on the re-measurement as well as on the first run (on the H100 of 2026-11-23, one
    forward re-measured at 1.49x its first time).  Every row of a re-measured shape, the references' too, keeps
    its better measurement, so the impls of that shape are still compared on the same footing.
    """
    measured = [row for row in (first, second) if row["status"] == STATUS_OK]
    return min(measured, key=lambda row: row["total_ms"]) if measured else second


def run_grid(cases: list[Case], args, device: torch.device, out: Path | None = None) -> list[dict]:
    """Run every case in order and return the rows (speedups filled).

    Larger N of an impl that was too slow at a smaller N are skipped, not run.  Cases left when
    ``--time-budget-s`` is spent are written as skipped.  With ``out``, each row is appended to the CSV as soon as
    it is measured (the file is rewritten with the speedups at the end), so that a killed run keeps its rows.
    """
    machine = machine_info(device)
    progress = Progress(len(cases), enabled=not args.quiet)
    too_slow: dict[tuple, int] = {}  # (dtype, mode, impl, D, causal) -> the N where it was too slow
    start = time.perf_counter()
    rows: list[dict] = []
    for case in cases:
        group = (case.dtype, case.mode, case.impl, case.D, case.causal)
        if args.time_budget_s and time.perf_counter() - start > args.time_budget_s:
            result = {"status": f"skipped: not run, --time-budget-s {args.time_budget_s:g} spent"}
        elif group in too_slow:
            result = {"status": f"skipped: too slow at N={too_slow[group]} (--max-call-s)"}
        else:
            tuned_before = set(tuning.tuned_report())
            result = run_case(case, args, device)
            for key, line in tuning.tuned_report().items():  # what the tuner chose, for the log
                if key not in tuned_before:
                    print(f"[tuned] {line}", file=sys.stderr)
            if result["status"].startswith("skipped: too slow"):
                too_slow[group] = case.N
        rows.append({**machine, **case.row(), **result})
        if out is not None:
            write_csv(out, rows[-1:], append=len(rows) > 1)
        outcome = result["status"]
        if status_kind(outcome) == STATUS_OK:
            outcome = f"{result['total_ms']:.3f} ms"
        progress.advance(case.label(), outcome)
    if args.recheck:
        forward_code = {
            impl_registry.impl_label(case.impl): impl_registry.get_impl(case.impl).forward_code() for case in cases
        }
        for shape in inconsistent_shapes(rows, args.recheck, forward_code):
            if args.time_budget_s and time.perf_counter() - start > args.time_budget_s:
                print(f"not re-measured (--time-budget-s spent): {shape}", file=sys.stderr)
                continue
            for i, case in enumerate(cases):
                if tuple(rows[i][c] for c in SHAPE_COLUMNS) == shape:
                    rows[i] = faster_of(rows[i], {**machine, **case.row(), **run_case(case, args, device)})
            print(f"re-measured {shape}: forward times apart by more than {args.recheck:g}x", file=sys.stderr)
    fill_speedups(rows)
    return rows


def main(argv: list[str]) -> int:
    if argv and argv[0] == "ab":  # the subcommand that times impls against each other in alternating rounds
        from .ab import main as ab_main

        return ab_main(argv[1:])
    args = parse_args(argv)
    device = torch.device(args.device)
    cases = build_grid(args)
    start = time.perf_counter()
    out = Path(args.out or f"bench/results/{machine_tag(machine_info(device)['gpu_name'])}_bench.csv")
    with tuning.autotuning(True) if args.autotune else contextlib.nullcontext():
        rows = run_grid(cases, args, device, out)
    write_csv(out, rows)
    counts: dict[str, int] = {}
    for row in rows:
        counts[status_kind(row["status"])] = counts.get(status_kind(row["status"]), 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    print(f"wrote {len(rows)} rows to {out} ({summary}) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0
