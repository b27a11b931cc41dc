"""``python -m attnzoo bench ab``: two or more implementations timed on the same inputs, in alternating rounds.

One grid row is one timing, and timings of one kernel minutes apart differ by a few percent (bench/README.md), so a
ratio near 1.0 in the grid does not say which side is faster.  Here every shape's inputs are drawn once and every
impl is timed on them in each of ``--rounds`` rounds, the order reversed every other round so that a drift of the
machine's state falls on all impls alike.  The table gives each impl's median over the rounds and its ratio to the
first impl (above 1: faster than the first), with the range of the per-round ratios.

An impl is a bench impl name (``python -m attnzoo bench --help`` lists them), optionally with backend options after
a colon, comma-separated: ``triton_atomic:delta=recompute``, or a pinned kernel config
``triton_2kernel:configs.forward=128x64 w8 s3 tma`` (options go to the backend's constructor; see ``make_impl``).

    python -m attnzoo bench ab triton_2kernel flex_attention sdpa_flash --dtype fp16 --d 128 --N 2k,8k --rounds 5
    python -m attnzoo bench ab "triton_2kernel:configs.forward=128x128 w8 s3 gluon" \\
        "triton_2kernel:configs.forward=128x64 w8 s3 tma" --mode fwd --d 128 --N 8k

``--replot CSV [CSV ...]`` reads such CSVs instead of timing: per shape, each impl's median forward and backward
time and its backward (forward in fwd mode) ratio to the first impl, as a table and, with ``--plot PNG``, a figure.

    python -m attnzoo bench ab --replot bench/results/h100_five_product.csv --plot bench/results/h100_five_product.png
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import attnzoo

from .. import cli
from . import impls as impl_registry
from . import timing
from .plot import _pyplot
from .run import CPU_DEFAULTS, DTYPE_NAMES, DTYPES, GPU_DEFAULTS, Case, make_inputs
from .schema import backward_flops, forward_flops, parse_lengths, tflops


@dataclass(frozen=True)
class ImplSpec:
    """One side of the comparison: a bench impl name and the backend options it is built with."""

    text: str  # as given on the command line (the table's label)
    name: str
    options: dict


def parse_spec(text: str) -> ImplSpec:
    """``name`` or ``name:key=value,key=value``; a key ``configs.<kernel>`` collects into ``options["configs"]``.

    Raises ``ValueError`` for an unknown name or a malformed option."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in impl_registry.impl_names():
        raise ValueError(cli.unknown_name("impl", name, impl_registry.impl_names()))
    options: dict = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"impl {text!r}: option {item!r} is not key=value")
        key, value = key.strip(), value.strip()
        if key.startswith("configs."):
            options.setdefault("configs", {})[key.removeprefix("configs.")] = value
        else:
            options[key] = value
    if options and name not in attnzoo.names():
        raise ValueError(f"impl {text!r}: options apply to attnzoo backends only ({', '.join(attnzoo.names())})")
    return ImplSpec(text, name, options)


def make_impl(spec: ImplSpec) -> impl_registry.Impl:
    """The bench adapter of ``spec``: with options, a ``BackendImpl`` that builds ``attnzoo.get(name, **options)``
    (``delta=recompute``, pinned ``configs``); an option the backend does not take is a ``ValueError`` here, before
    any timing."""
    if not spec.options:
        return impl_registry.get_impl(spec.name)
    try:
        return impl_registry.BackendImpl(spec.text)  # attnzoo.get(name, **options), under the spec's label
    except TypeError as exc:
        raise ValueError(f"impl {spec.text!r}: backend {spec.name!r} does not take these options ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m attnzoo bench ab",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every impl ran every shape; 1 when one could not; 2 for a bad flag.",
    )
    p.add_argument("impls", nargs="*", metavar="IMPL", help="two or more impls; ratios are to the first")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu", help="default: cuda if any")
    p.add_argument("--mode", choices=["fwd", "train"], default="train", help="train: forward and backward, each alone")
    p.add_argument("--dtype", default=defaults["dtype"].split(",")[0], help="fp16, bf16, fp32 or fp64")
    p.add_argument("--d", type=cli.positive_int_list, default=defaults["d"], help="head dims, comma list")
    p.add_argument("--N", default=defaults["N"], help="sequence lengths, comma list (2k = 2048)")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="no", help="bottom-right causal mask")
    p.add_argument("--tokens", type=cli.positive_int, default=defaults["tokens"], help="B = tokens / N")
    p.add_argument("--width", type=cli.positive_int, default=defaults["width"], help="H = width / D")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="alternating rounds per shape")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3 if cuda else 1, help="untimed calls per timing")
    p.add_argument("--repeat", type=cli.positive_int, default=10 if cuda else 3, help="timed calls (median)")
    p.add_argument(
        "--warmup-ms", type=cli.nonnegative_float, default=100.0 if cuda else 0.0, help="untimed calls run this long"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (drawn once per shape)")
    p.add_argument("--out", default=None, help="CSV of every (shape, round, impl) timing")
    p.add_argument("--replot", nargs="+", default=None, metavar="CSV", help="summarise these CSVs, time nothing")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --replot: draw the ratios to the first impl")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[impl_registry.Impl]]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.replot is not None:
        if args.impls:
            p.error("--replot reads CSVs: give no impls")
        return args, []
    if args.plot is not None:
        p.error("--plot draws a --replot summary")
    cli.check_device(p, args.device)
    if len(args.impls) < 2:
        p.error(f"give two or more impls to compare, got {len(args.impls)}")
    try:
        specs = [parse_spec(text) for text in args.impls]
        impls = [make_impl(spec) for spec in specs]  # options a backend does not take fail here, before any timing
        cli.pick_names(args.dtype, DTYPES, "dtype")
    except ValueError as exc:
        p.error(str(exc))
    try:
        args.N = parse_lengths(args.N)
    except ValueError:
        args.N = []
    if not args.N or min(args.N) < 1:
        p.error("--N must be a comma list of positive lengths (2k = 2048)")
    return args, impls


def time_impl(impl: impl_registry.Impl, inputs: impl_registry.Inputs, train: bool, args) -> tuple[float, float | None]:
    """Forward ms (and backward ms alone in train mode) of one impl on ``inputs``."""
    device = inputs.device
    prepared = impl.prepare(inputs, train)
    prepared.step()  # compilation and autotuning: never timed
    fwd_ms = timing.median_ms(prepared.forward, device, args.warmup, args.repeat, args.warmup_ms)
    bwd_ms = None
    if train:
        backward = prepared.make_backward()
        bwd_ms = timing.median_ms(backward, device, args.warmup, args.repeat, args.warmup_ms)
    return fwd_ms, bwd_ms


def summarize(paths: list[str]) -> dict[str, dict[str, tuple[float, float | None]]]:
    """shape -> impl -> (median forward ms, median backward ms or None) over the rounds of ab CSVs, in the order
    the CSVs list them."""
    fwd: dict[str, dict[str, list[float]]] = {}
    bwd: dict[str, dict[str, list[float]]] = {}
    for path in paths:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                fwd.setdefault(row["shape"], {}).setdefault(row["impl"], []).append(float(row["fwd_ms"]))
                if row["bwd_ms"]:
                    bwd.setdefault(row["shape"], {}).setdefault(row["impl"], []).append(float(row["bwd_ms"]))
    return {
        shape: {
            impl: (
                statistics.median(times),
                statistics.median(bwd[shape][impl]) if impl in bwd.get(shape, {}) else None,
            )
            for impl, times in impls.items()
        }
        for shape, impls in fwd.items()
    }


def _speedup(first: tuple[float, float | None], this: tuple[float, float | None]) -> float:
    """The first impl's backward time over this one's, (forward, backward) ms pairs; the forwards' where either has
    no backward."""
    (first_fwd, first_bwd), (fwd_ms, bwd_ms) = first, this
    return first_bwd / bwd_ms if first_bwd and bwd_ms else first_fwd / fwd_ms


def summary_table(summary: dict[str, dict[str, tuple[float, float | None]]]) -> str:
    """One block per shape: median forward and backward ms of each impl, and the first impl's backward time over
    its own (the forward's where there is no backward; above 1: faster than the first)."""
    lines = []
    for shape, impls in summary.items():
        first = next(iter(impls.values()))
        lines.append(f"{shape}:")
        for impl, (fwd_ms, bwd_ms) in impls.items():
            ratio = _speedup(first, (fwd_ms, bwd_ms))
            bwd_text = f"{bwd_ms:9.3f}" if bwd_ms is not None else "        -"
            lines.append(f"  {impl:<40} fwd {fwd_ms:9.3f} ms  bwd {bwd_text} ms  x{ratio:.3f}")
    return "\n".join(lines)


def plot_summary(summary: dict[str, dict[str, tuple[float, float | None]]], png: str) -> None:
    """Bars per shape: each impl's backward speed relative to the first impl (forward where there is none)."""
    plt = _pyplot()
    shapes = list(summary)
    impls = list(dict.fromkeys(impl for row in summary.values() for impl in row))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(shapes) * len(impls) * width + 3), 4.5))
    for i, impl in enumerate(impls):
        values = []
        for shape in shapes:
            first = next(iter(summary[shape].values()))
            values.append(_speedup(first, summary[shape].get(impl, (float("nan"), None))))
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], [s.split(" B=")[0] for s in shapes])
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.set_ylabel(f"speed relative to {impls[0]} (backward)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args, impls = parse_args(argv)
    if args.replot is not None:
        summary = summarize(args.replot)
        print(summary_table(summary))
        if args.plot:
            plot_summary(summary, args.plot)
        return 0
    device, dtype, train = torch.device(args.device), DTYPES[args.dtype], args.mode == "train"
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    rows, failed = [], False
    for D in args.d:
        H = max(1, args.width // D)
        for causal in causals:
            for N in sorted(args.N):
                B = max(1, args.tokens // N)
                case = Case(dtype, args.mode, "ab", B, H, H, N, D, causal, N)
                inputs = make_inputs(case, device, args.seed)  # one draw, every impl times these tensors
                label = f"{DTYPE_NAMES[dtype]} D={D} N={N} {'causal' if causal else 'full'} B={B} H={H}"
                reasons = {impl.name: impl.reasons(inputs) for impl in impls}
                if any(reasons.values()):
                    failed = True
                    why = "; ".join(f"{name}: {', '.join(r)}" for name, r in reasons.items() if r)
                    print(f"{label}: not run ({why})", file=sys.stderr)
                    continue
                times: dict[str, list[float]] = {impl.name: [] for impl in impls}
                for round_index in range(args.rounds):
                    order = impls if round_index % 2 == 0 else impls[::-1]
                    for impl in order:
                        fwd_ms, bwd_ms = time_impl(impl, inputs, train, args)
                        total = fwd_ms + (bwd_ms or 0.0)
                        times[impl.name].append(total)
                        rows.append(dict(shape=label, round=round_index, impl=impl.name, fwd_ms=fwd_ms, bwd_ms=bwd_ms))
                print(_table(label, times, case))
    if args.out:
        with Path(args.out).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["shape", "round", "impl", "fwd_ms", "bwd_ms"])
            writer.writeheader()
            writer.writerows(rows)
    return 1 if failed else 0


def _table(label: str, times: dict[str, list[float]], case: Case) -> str:
    """One block per shape: each impl's median ms and TFLOP/s over the rounds, and its ratio to the first impl's
    time (above 1: faster than the first) with the range of the per-round ratios."""
    shape = (case.B, case.H, case.N, case.D, case.causal, case.seqlen_k)
    flops = forward_flops(*shape) + (backward_flops(*shape) if case.train else 0.0)
    first = next(iter(times.values()))
    lines = [f"{label} ({case.mode}, {len(first)} rounds):"]
    for name, totals in times.items():
        median = statistics.median(totals)
        ratios = [a / b for a, b in zip(first, totals, strict=True)]
        lines.append(
            f"  {name:<40} {median:9.3f} ms  {tflops(flops, median) or 0.0:7.1f} TFLOP/s  "
            f"x{statistics.median(first) / median:.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
        )
    return "\n".join(lines)
