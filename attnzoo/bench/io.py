"""``python -m attnzoo io``: IO complexity of attention, in theory and as DRAM bytes measured by Nsight Compute.

Subcommands:

* ``theory`` (the default, no GPU): modelled HBM bytes of standard attention, FlashAttention (Algorithm 1) and the
  FlashAttention-2 loop order over N, as a CSV (formulas in :mod:`attnzoo.bench.io_theory`).
* ``measure`` (GPU machine with ncu): for each (impl, N, pass), profile one forward or one backward under ncu,
  sum DRAM bytes read/written and GPU time over its kernels, and write them beside the theory; also measures the
  roofline ceilings in the same run (a large device copy, a large bf16 matmul).
* ``target`` (internal): the small driver process that ncu profiles.
* ``plot``: the roofline figure and bytes-vs-theory figure from a ``measure`` CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cli import positive_int
from . import ncu as ncu_tools
from .io_theory import H100_SRAM_BYTES, THEORY_COLUMNS, theory_row
from .schema import parse_lengths

MEASURE_COLUMNS = [
    "gpu_name",
    "driver",
    "torch_version",
    "triton_version",
    "impl",
    "pass",
    "dtype",
    "B",
    "H",
    "N",
    "D",
    "causal",
    "kernels",
    "dram_read_bytes",
    "dram_write_bytes",
    "dram_bytes",
    "gpu_ms",
    "kernel_ms",
    "achieved_TBps",
    "achieved_TFLOPs",
    "arithmetic_intensity",
    "minimum_bytes",
    "standard_bytes",
    "standard_fp32_bytes",
    "flash1_bytes",
    "flash2_bytes",
    "measured_over_standard",
    "measured_over_standard_fp32",
    "measured_over_flash2",
    "copy_TBps",
    "matmul_TFLOPs",
    "status",
]


def _write(path: Path | None, columns: list[str], rows: list[dict]) -> None:
    stream = sys.stdout if path is None else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = path.open("w", newline="")
    writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: f"{row[c]:.6g}" if isinstance(row.get(c), float) else row.get(c, "") for c in columns})
    if path is not None:
        stream.close()


# -- theory -------------------------------------------------------------------------------------------------------
def theory_rows(Ns: list[int], Ds: list[int], B: int, H: int, elem_bytes: int, sram_bytes: int) -> list[dict]:
    """Modelled bytes for every (pass, D, N)."""
    return [
        theory_row(pass_, N, D, B, H, elem_bytes, sram_bytes).as_row()
        for pass_ in ("fwd", "bwd")
        for D in Ds
        for N in Ns
    ]


def cmd_theory(args: argparse.Namespace) -> int:
    rows = theory_rows(parse_lengths(args.N), parse_lengths(args.D), args.B, args.H, args.elem_bytes, args.sram_bytes)
    _write(Path(args.out) if args.out else None, THEORY_COLUMNS, rows)
    return 0


# -- target: what ncu profiles --------------------------------------------------------------------------------------
def cmd_target(args: argparse.Namespace) -> int:
    """Warm up, then run exactly one forward or one backward between cudaProfilerStart and cudaProfilerStop."""
    import torch

    from .impls import get_impl
    from .run import DTYPES, Case, make_inputs

    device = torch.device("cuda")
    case = Case(
        DTYPES[args.dtype], "train" if args.pass_ == "bwd" else "fwd", args.impl, args.B, args.H, args.H,
        args.N, args.D, args.causal == "yes", args.N,
    )  # fmt: skip
    impl = get_impl(args.impl)
    inputs = make_inputs(case, device, seed=0)
    reasons = impl.reasons(inputs)
    if reasons:
        print("skipped: " + "; ".join(reasons), file=sys.stderr)
        return 3
    prepared = impl.prepare(inputs, case.train)
    for _ in range(2):  # compilation, autotuning and handle creation stay outside the profiled range
        prepared.step()
    call = prepared.make_backward() if case.train else prepared.forward
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


# -- measure --------------------------------------------------------------------------------------------------------
def measure_ceilings() -> dict[str, float]:
    """Roofline ceilings measured here: device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    import torch

    from .timing import median_ms

    device = torch.device("cuda")
    src = torch.randn(2**28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, warmup=3, repeat=10)
    copy_tbps = 2 * src.numel() * 4 / (copy_ms * 1e-3) / 1e12
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, device, warmup=3, repeat=10)
    return {"copy_TBps": copy_tbps, "matmul_TFLOPs": 2 * n**3 / (mm_ms * 1e-3) / 1e12}


def measure_one(args: argparse.Namespace, impl: str, N: int, pass_: str, ncu: str) -> dict:
    """Profile one (impl, N, pass) under ncu and return the summed metrics (or a status saying why not)."""
    target = [
        sys.executable, "-m", "attnzoo", "io", "target", "--impl", impl, "--N", str(N), "--D", str(args.D),
        "--B", str(args.B), "--H", str(args.H), "--dtype", args.dtype, "--causal", args.causal, "--pass", pass_,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        try:
            proc = subprocess.run(
                ncu_tools.ncu_command(log, target, ncu), capture_output=True, text=True, timeout=args.timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"status": f"error: ncu took more than {args.timeout_s} s"}
        text = Path(log).read_text() if os.path.exists(log) else ""
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
        (Path(args.keep_logs) / f"ncu_{impl}_{pass_}_{N}.csv").write_text(text + proc.stdout + proc.stderr)
    if proc.returncode == 3:
        return {"status": proc.stderr.strip().splitlines()[-1]}
    kernels = ncu_tools.parse_ncu_csv(text)
    if proc.returncode != 0 or not kernels:
        tail = (proc.stderr or proc.stdout or text).strip().splitlines()[-3:]
        return {"status": f"error: ncu rc={proc.returncode}: {' | '.join(tail)[:300]}"}
    return {**ncu_tools.summed(kernels), "status": "ok"}


def cmd_measure(args: argparse.Namespace) -> int:
    from .machine import machine_info
    from .schema import backward_flops, forward_flops

    ncu = args.ncu or ncu_tools.find_ncu()
    if ncu is None:
        print("ncu not found (Nsight Compute); the measurement needs the GPU machine", file=sys.stderr)
        return 2
    machine = machine_info()
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s")
    elem_bytes = 4 if args.dtype in ("fp32", "float32") else 2
    causal = args.causal == "yes"
    rows = []
    begin = time.perf_counter()
    for impl in args.impl.split(","):
        for N in parse_lengths(args.N):
            for pass_ in args.pass_.split(","):
                start = time.perf_counter()
                if args.time_budget_s and start - begin > args.time_budget_s:
                    result = {"status": f"skipped: not run, --time-budget-s {args.time_budget_s:g} spent"}
                else:
                    result = measure_one(args, impl, N, pass_, ncu)
                theory = theory_row(pass_, N, args.D, args.B, args.H, elem_bytes, args.sram_bytes).as_row()
                flops_fn = forward_flops if pass_ == "fwd" else backward_flops
                flops = flops_fn(args.B, args.H, N, args.D, causal)
                row = {**machine, **ceilings, **result, "impl": impl, "pass": pass_, "dtype": args.dtype}
                row.update(B=args.B, H=args.H, N=N, D=args.D, causal="yes" if causal else "no")
                for key in ("minimum_bytes", "standard_bytes", "standard_fp32_bytes", "flash1_bytes", "flash2_bytes"):
                    row[key] = theory[key]
                if result["status"] == "ok":
                    total = result["dram_read_bytes"] + result["dram_write_bytes"]
                    seconds = result["gpu_seconds"]
                    row.update(
                        dram_bytes=total,
                        gpu_ms=seconds * 1e3,
                        achieved_TBps=total / seconds / 1e12,
                        achieved_TFLOPs=flops / seconds / 1e12,
                        arithmetic_intensity=flops / total,
                        measured_over_standard=total / theory["standard_bytes"],
                        measured_over_standard_fp32=total / theory["standard_fp32_bytes"],
                        measured_over_flash2=total / theory["flash2_bytes"],
                    )
                rows.append(row)
                took = time.perf_counter() - start
                summary = f"{row.get('dram_bytes', 0) / 1e6:10.1f} MB" if result["status"] == "ok" else result["status"]
                print(f"{impl:>16} {pass_} N={N:<6} {summary}  ({took:.0f} s)", flush=True)
    _write(Path(args.out), MEASURE_COLUMNS, rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


# -- plot ------------------------------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> int:
    from .io_plot import plot_io

    written = plot_io(Path(args.csv), Path(args.out_dir), args.prefix)
    for path in written:
        print(path)
    return 0


def _lengths(text: str) -> str:
    """A comma list of sequence lengths, checked and passed on as text (the commands parse it)."""
    try:
        values = parse_lengths(text)
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a comma list of positive lengths (2k = 2048), got {text!r}")
    return text


def _check_measure_csv(path: Path) -> None:
    """Refuse, in one line, a file that is not an ``io measure`` CSV (a bench CSV, say)."""
    if not path.is_file():
        raise SystemExit(f"python -m attnzoo io plot: error: {path}: no such file")
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    missing = [c for c in ("impl", "pass", "N", "dram_read_bytes", "copy_TBps") if c not in header]
    if missing:
        raise SystemExit(
            f"python -m attnzoo io plot: error: {path} is not a CSV of python -m attnzoo io measure "
            f"(no column {', '.join(missing)})"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnzoo io", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", help="theory when none is given")

    theory = sub.add_parser("theory", help="modelled HBM bytes over N (no GPU)")
    theory.add_argument("--N", type=_lengths, default="512,1024,2048,4096,8192,16384", help="sequence lengths")
    theory.add_argument("--D", type=_lengths, default="64,128", help="head dims, comma list")
    theory.add_argument("--B", type=positive_int, default=1, help="batch size")
    theory.add_argument("--H", type=positive_int, default=16, help="heads")
    theory.add_argument("--elem-bytes", type=positive_int, default=2, help="bytes per element (2 for fp16/bf16)")
    theory.add_argument(
        "--sram-bytes", type=positive_int, default=H100_SRAM_BYTES, help="M of the analysis (H100: 227 KB)"
    )
    theory.add_argument("--out", default=None, help="CSV path (default: stdout)")

    def shape_args(q: argparse.ArgumentParser, N: str) -> None:
        q.add_argument("--impl", default="triton_2kernel,sdpa_flash,sdpa_math", help="comma list of bench impls")
        q.add_argument("--N", default=N, help="sequence lengths, comma list (2k = 2048)")
        q.add_argument("--D", type=positive_int, default=128, help="head dim")
        q.add_argument("--B", type=positive_int, default=1, help="batch size")
        q.add_argument("--H", type=positive_int, default=16, help="heads")
        q.add_argument("--dtype", default="fp16", help="fp16, bf16, fp32 or fp64")
        q.add_argument("--causal", default="no", choices=["yes", "no"], help="causal mask")

    target = sub.add_parser("target", help="internal: one profiled call, run under ncu")
    shape_args(target, "1024")
    target.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"], help="which pass to profile")

    measure = sub.add_parser("measure", help="DRAM bytes per (impl, N, pass) with ncu (GPU machine)")
    shape_args(measure, "1024,4096,16384")
    measure.add_argument("--pass", dest="pass_", default="fwd,bwd", help="fwd, bwd or both (comma list)")
    measure.add_argument(
        "--sram-bytes", type=positive_int, default=H100_SRAM_BYTES, help="M of the model columns (H100: 227 KB)"
    )
    measure.add_argument("--ncu", default=None, help="path of ncu (default: from PATH)")
    measure.add_argument("--timeout-s", type=int, default=300, help="limit for one ncu process")
    measure.add_argument("--time-budget-s", type=float, default=0, help="start no profile after this (0: no limit)")
    measure.add_argument("--out", default="io_ncu.csv", help="CSV path")
    measure.add_argument("--keep-logs", default=None, help="folder for ncu's raw output, one file per profile")

    plot = sub.add_parser("plot", help="roofline and bytes-vs-theory figures from a measure CSV")
    plot.add_argument("csv", help="a CSV written by python -m attnzoo io measure")
    plot.add_argument("--out-dir", default="bench/results", help="where the PNGs go")
    plot.add_argument("--prefix", default=None, help="file-name prefix (default: machine tag from the CSV)")

    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["theory", *argv]  # theory is the default subcommand
    args = build_parser().parse_args(argv)
    if args.command == "target":
        args.N = int(parse_lengths(args.N)[0])
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "plot":
        _check_measure_csv(Path(args.csv))
    commands = {"theory": cmd_theory, "target": cmd_target, "measure": cmd_measure, "plot": cmd_plot}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
