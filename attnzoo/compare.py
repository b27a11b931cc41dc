"""``python -m attnzoo compare``: every backend on one case, against the float64 oracle.

Prints one table (backend, supported or why not, max error of o, lse, dq, dk, dv as a multiple of
SPEC.md's bound, forward/backward time, peak memory) and exits non-zero if any supported backend
is outside tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import cli as cli_types
from . import oracle, testing
from .backend import Backend, get, names
from .validation import validate_forward

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OUTPUTS = ("o", "lse", "dq", "dk", "dv")

# The embedded defaults: seconds on a laptop CPU; a larger, low-precision case on a GPU.
CPU_DEFAULT = dict(B=2, H=4, Hkv=2, Nq=256, Nk=256, D=64, dtype="float32")
GPU_DEFAULT = dict(B=2, H=16, Hkv=4, Nq=2048, Nk=2048, D=128, dtype="float16")


@dataclass
class Row:
    backend: str
    reasons: list[str] = field(default_factory=list)
    checks: dict[str, oracle.Check] = field(default_factory=dict)
    fwd_ms: float = float("nan")
    bwd_ms: float = float("nan")
    peak_mb: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(c.ok for c in self.checks.values())


def parse_window(text: str) -> tuple[int | None, int | None]:
    """``--window L,R``: two ints, either of them ``none`` (unbounded on that side)."""
    sides = text.split(",")
    try:
        if len(sides) != 2:
            raise ValueError
        return tuple(None if side.strip().lower() == "none" else int(side) for side in sides)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints or 'none'), got {text!r}") from None


def parse_lengths(text: str) -> list[int]:
    """``--varlen 300,0,17``: non-negative ints, at least one."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths (ints >= 0), got {text!r}") from None
    if any(n < 0 for n in lengths):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    return lengths


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's standard slopes (BLOOM): the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power of two; for
    other head counts, those of the next lower power of two, then every other one of twice that many."""

    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 2 ** int(math.log2(heads)) if heads > 0 else 0
    return powers(lower) + powers(2 * lower)[0::2][: heads - lower] if lower else []


def _parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="python -m attnzoo compare",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every supported backend is within tolerance; 1 when one is not, or when no "
        "selected backend supports the case; 2 for a bad flag.",
    )
    cli.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda when available, else cpu"
    )
    sizes = {
        "B": (cli_types.nonnegative_int, "batch size"),
        "H": (cli_types.positive_int, "query heads"),
        "Hkv": (cli_types.positive_int, "K/V heads; H must be a multiple of it (grouped-query attention)"),
        "Nq": (cli_types.nonnegative_int, "query rows"),
        "Nk": (cli_types.nonnegative_int, "keys (default: Nq when --Nq is given)"),
        "D": (cli_types.positive_int, "head dim"),
    }
    for name, (kind, about) in sizes.items():
        cli.add_argument(f"--{name}", type=kind, help=f"{about}; default: the embedded case for the device")
    cli.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on the CPU, float16 on a GPU")
    cli.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    cli.add_argument(
        "--seqlens-k", help="keys per batch, a comma list of B values in [0, Nk] (e.g. 256,100), or 'random'"
    )
    cli.add_argument("--scale", type=cli_types.finite_float, help="score scale; default 1/sqrt(D)")
    cli.add_argument(
        "--window", type=parse_window, metavar="LEFT,RIGHT",
        help="sliding window: row i sees keys i'-LEFT .. i'+RIGHT, e.g. 128,0 or none,0 (none: unbounded)",
    )  # fmt: skip
    cli.add_argument("--softcap", type=cli_types.finite_float, default=0.0, help="logit soft cap (0: off)")
    cli.add_argument("--alibi", action="store_true", help="ALiBi with BLOOM's standard slopes per head")
    cli.add_argument("--Dv", type=cli_types.positive_int, help="value head dim (default: D)")
    cli.add_argument(
        "--varlen", type=parse_lengths, metavar="N1,N2,...",
        help="a packed variable-length batch (attention_varlen) of sequences of these lengths (0 allowed) instead of "
        "--B/--Nq/--Nk, e.g. 300,0,17,64",
    )  # fmt: skip
    cli.add_argument(
        "--varlen-k", type=parse_lengths, metavar="N1,N2,...", help="with --varlen: key lengths (default: as --varlen)"
    )
    cli.add_argument("--backends", help=f"comma-separated subset of: {', '.join(names())} (default: all)")
    cli.add_argument(
        "--repeat", type=cli_types.positive_int, default=3, help="timed runs per backend, after one warm-up (median)"
    )
    cli.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return cli


def _parse(argv: list[str]) -> tuple[argparse.Namespace, dict, str, list[str]]:
    """Parse and check every flag before any input exists: returns the arguments, the case's shape, the device
    and the selected backends.  A bad flag or an impossible case is a usage error (one line, exit 2)."""
    cli = _parser()
    args = cli.parse_args(argv)
    cli_types.check_device(cli, args.device)
    shape, device = _case(args)
    if shape["H"] % shape["Hkv"] != 0:
        cli.error(
            f"--H {shape['H']} is not a multiple of --Hkv {shape['Hkv']} (each K/V head serves H / Hkv query heads)"
        )
    try:
        selected = names() if not args.backends else cli_types.pick_names(args.backends, names(), "backend")
    except ValueError as exc:
        cli.error(f"--backends: {exc}")
    if args.varlen is None and args.varlen_k is not None:
        cli.error("--varlen-k needs --varlen (the query lengths)")
    if args.varlen is not None:
        if args.varlen_k is not None and len(args.varlen_k) != len(args.varlen):
            cli.error(f"--varlen-k needs one length per sequence ({len(args.varlen)}), got {len(args.varlen_k)}")
        if args.seqlens_k is not None or any(getattr(args, n) is not None for n in ("B", "Nq", "Nk")):
            cli.error("--varlen sets the sequences: it takes no --B, --Nq, --Nk or --seqlens-k")
    if args.seqlens_k not in (None, "random"):
        try:
            seqlens = [int(s) for s in args.seqlens_k.split(",")]
        except ValueError:
            cli.error(f"--seqlens-k must be a comma list of integers or 'random', got {args.seqlens_k!r}")
        if len(seqlens) != shape["B"]:
            cli.error(f"--seqlens-k needs one value per batch (B = {shape['B']}), got {len(seqlens)}: {args.seqlens_k}")
        if any(not 0 <= s <= shape["Nk"] for s in seqlens):
            cli.error(f"--seqlens-k values must lie in [0, Nk] = [0, {shape['Nk']}], got {args.seqlens_k}")
    return args, shape, device, selected


def _case(args: argparse.Namespace) -> tuple[dict, str]:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(GPU_DEFAULT if device == "cuda" else CPU_DEFAULT)
    for key in ("B", "H", "Hkv", "Nq", "Nk", "D", "Dv", "dtype"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.Nq is not None and args.Nk is None:
        shape["Nk"] = args.Nq
    shape.setdefault("Dv", shape["D"])
    return shape, device


def _inputs(shape: dict, device: str, args: argparse.Namespace) -> testing.AttentionInputs:
    B, Nk = shape["B"], shape["Nk"]
    seqlens = None
    if args.seqlens_k == "random":
        seqlens = torch.randint(0, Nk + 1, (B,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    elif args.seqlens_k:
        seqlens = [int(s) for s in args.seqlens_k.split(",")]
    x = testing.random_inputs(
        B, shape["H"], shape["Hkv"], shape["Nq"], Nk, shape["D"],
        dtype=DTYPES[shape["dtype"]], device=device, seed=args.seed, seqlens_k=seqlens, head_dim_v=shape["Dv"],
    )  # fmt: skip
    if args.alibi:
        x = dataclasses.replace(x, alibi_slopes=torch.tensor(alibi_slopes(shape["H"]), device=device))
    return x


def _timed(fn: Callable[[], tuple], device: str, repeat: int) -> tuple[tuple, float]:
    """Run ``fn`` once to warm up (compilation, autotuning), then ``repeat`` times; return a result, median ms."""
    result = fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def _peak_mb(fn: Callable[[], tuple], device: str, numpy_backend: bool) -> float | None:
    """Peak memory of one call beyond what was allocated before it: the CUDA allocator's counter on a GPU;
    on the CPU tracemalloc, which sees NumPy's allocations only, so only for a NumPy backend (None otherwise)."""
    if device == "cpu" and not numpy_backend:
        return None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def run_backend(
    backend: Backend,
    x: testing.AttentionInputs,
    causal: bool,
    scale: float | None,
    device: str,
    repeat: int,
    judge: testing.Oracle | None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
) -> Row:
    """One table row: support, errors vs the oracle (``judge``, run once on ``x`` for every backend), times and
    peak memory of forward + backward."""
    row = Row(backend.name)
    kw = dict(causal=causal, scale=scale, seqlens_k=x.seqlens_k, window=window, softcap=softcap)
    kw["alibi_slopes"] = x.alibi_slopes
    try:
        row.reasons = backend.not_supported_reasons(x.q, x.k, x.v, **kw)
    except ValueError as exc:  # beyond the backend's limits, e.g. its largest head dim
        row.reasons = [str(exc)]
    if row.reasons:
        return row
    try:
        (o, lse), row.fwd_ms = _timed(lambda: backend.forward(x.q, x.k, x.v, **kw), device, repeat)
        grads, row.bwd_ms = _timed(lambda: backend.backward(x.do, x.q, x.k, x.v, o, lse, **kw), device, repeat)
        row.peak_mb = _peak_mb(
            lambda: backend.backward(x.do, x.q, x.k, x.v, *backend.forward(x.q, x.k, x.v, **kw), **kw),
            device,
            backend.capabilities.accepts_numpy,
        )
    except Exception as exc:  # a crash is a failed row, not a crashed comparison
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    # Judged with Delta from the o this backend's backward was handed (see oracle.contract_errors).
    row.checks = judge.check(dict(zip(OUTPUTS, (o, lse, *grads), strict=True)))
    return row


def format_table(rows: list[Row]) -> str:
    header = ["backend", "status", *[f"{n} err (x bound)" for n in OUTPUTS], "fwd ms", "bwd ms", "peak MB"]
    lines = []
    for row in rows:
        if row.reasons:
            status = "unsupported: " + "; ".join(row.reasons)
        elif row.error:
            status = "ERROR " + row.error[:80]
        else:
            status = "ok" if row.ok else "OUT OF TOLERANCE"
        errs = [f"{row.checks[n].error:.1e} ({row.checks[n].ratio:.2f})" if n in row.checks else "-" for n in OUTPUTS]
        peak = "-" if row.peak_mb is None else f"{row.peak_mb:.1f}"
        times = [
            "-" if row.fwd_ms != row.fwd_ms else f"{row.fwd_ms:.2f}",
            "-" if row.bwd_ms != row.bwd_ms else f"{row.bwd_ms:.2f}",
        ]
        lines.append([row.backend, status, *errs, *times, peak])
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def run_varlen_backend(
    backend: Backend, x, causal: bool, scale: float | None, device: str, repeat: int, judge, window, softcap: float
) -> Row:
    """One table row of a packed call (``--varlen``): support, errors vs the per-sequence oracle, times."""
    from .varlen import run_varlen_backward, run_varlen_forward, validate_varlen

    row = Row(backend.name)
    problem = validate_varlen(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, None, None, causal, scale, window, softcap, x.alibi_slopes
    )
    row.reasons = backend.reasons_for(problem)  # a head dim above the backend's limit among them
    if row.reasons:
        return row
    try:
        (o, lse), row.fwd_ms = _timed(lambda: run_varlen_forward(backend, x.q, x.k, x.v, problem), device, repeat)
        grads, row.bwd_ms = _timed(
            lambda: run_varlen_backward(backend, x.do, x.q, x.k, x.v, o, lse, problem), device, repeat
        )
    except Exception as exc:  # a crash is a failed row, not a crashed comparison
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    row.checks = judge.check(dict(zip(OUTPUTS, (o, lse, *grads), strict=True)))
    return row


def main_varlen(args: argparse.Namespace, shape: dict, device: str, selected: list[str]) -> int:
    """``compare --varlen``: every selected backend on one packed batch, against the oracle run per sequence."""
    from . import testing_varlen

    lengths_k = args.varlen_k if args.varlen_k is not None else args.varlen
    x = testing_varlen.random_varlen_inputs(
        args.varlen, lengths_k, shape["H"], shape["Hkv"], shape["D"], dtype=DTYPES[shape["dtype"]], device=device,
        seed=args.seed, head_dim_v=shape["Dv"], alibi="heads" if args.alibi else "none",
    )  # fmt: skip
    if args.alibi:
        x = dataclasses.replace(x, alibi_slopes=torch.tensor(alibi_slopes(shape["H"]), device=device))
    try:  # bad values (a negative softcap, ...): one line, as for a bad flag
        from .varlen import validate_varlen

        validate_varlen(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, None, None, args.causal, args.scale,
                        args.window, args.softcap, x.alibi_slopes)  # fmt: skip
    except (TypeError, ValueError) as exc:
        print(f"python -m attnzoo compare: error: {exc}", file=sys.stderr)
        return 2
    judge = testing_varlen.varlen_oracle_for(x, args.causal, args.scale, window=args.window, softcap=args.softcap)
    extras = "" if args.window is None else f", window={args.window}"
    extras += f", softcap={args.softcap}" if args.softcap else ""
    extras += ", alibi" if args.alibi else ""
    print(
        f"case: packed varlen, query lengths {list(args.varlen)}, key lengths {list(lengths_k)}, H={shape['H']} "
        f"Hkv={shape['Hkv']} D={shape['D']} Dv={shape['Dv']} {shape['dtype']} causal={args.causal}{extras} on "
        f"{device}; errors are max |backend - float64 oracle per sequence|, (x bound) their ratio to SPEC.md's bound"
    )
    rows = [
        run_varlen_backend(get(n), x, args.causal, args.scale, device, args.repeat, judge, args.window, args.softcap)
        for n in selected
    ]
    print(format_table(rows))
    failed = [r.backend for r in rows if not r.reasons and not r.ok]
    if failed:
        print(f"outside tolerance: {', '.join(failed)}")
    if not any(not r.reasons for r in rows):
        print(f"no selected backend supports this case ({', '.join(selected)})", file=sys.stderr)
        return 1
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args, shape, device, selected = _parse(argv or [])
    if args.varlen is not None:
        return main_varlen(args, shape, device, selected)
    backends = [get(name) for name in selected]
    x = _inputs(shape, device, args)
    kw = dict(
        causal=args.causal,
        scale=args.scale,
        seqlens_k=x.seqlens_k,
        window=args.window,
        softcap=args.softcap,
        alibi_slopes=x.alibi_slopes,
    )
    try:  # bad values (a negative softcap, seqlens_k beyond Nk, ...): one line, as for a bad flag
        validate_forward(x.q, x.k, x.v, **kw)
    except (TypeError, ValueError) as exc:
        print(f"python -m attnzoo compare: error: {exc}", file=sys.stderr)
        return 2
    supported = {}
    for backend in backends:
        try:
            supported[backend.name] = not backend.not_supported_reasons(x.q, x.k, x.v, **kw)
        except ValueError:  # beyond the backend's limits, e.g. its largest head dim: its row says why
            supported[backend.name] = False
    if not any(supported.values()):
        # Nothing to judge: say why per backend and fail, without running the oracle on a case nobody runs.
        rows = [
            run_backend(b, x, args.causal, args.scale, device, args.repeat, None, args.window, args.softcap)
            for b in backends
        ]
        print(format_table(rows))
        print(f"no selected backend supports this case ({', '.join(selected)})", file=sys.stderr)
        return 1
    judge = testing.oracle_for(x, args.causal, args.scale, window=args.window, softcap=args.softcap)
    extras = "" if x.seqlens_k is None else f", seqlens_k={x.seqlens_k.tolist()}"
    extras += "" if args.window is None else f", window={args.window}"
    extras += f", softcap={args.softcap}" if args.softcap else ""
    extras += ", alibi" if args.alibi else ""
    dv = "" if shape["Dv"] == shape["D"] else f" Dv={shape['Dv']}"
    print(
        f"case: B={shape['B']} H={shape['H']} Hkv={shape['Hkv']} Nq={shape['Nq']} Nk={shape['Nk']} D={shape['D']}{dv} "
        f"{shape['dtype']} causal={args.causal}{extras} on {device}; errors are max |backend - float64 oracle|, "
        f"(x bound) their ratio to SPEC.md's bound"
    )
    rows = [
        run_backend(b, x, args.causal, args.scale, device, args.repeat, judge, args.window, args.softcap)
        for b in backends
    ]
    print(format_table(rows))
    failed = [r.backend for r in rows if not r.reasons and not r.ok]
    if failed:
        print(f"outside tolerance: {', '.join(failed)}")
    return 1 if failed else 0
