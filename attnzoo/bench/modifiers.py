"""``python -m attnzoo.bench.modifiers``: the score modifiers measured beside FlexAttention, in one run.

Three tables, one CSV (``--out``), a plot of time against window size (``--plot``):

- ``window``: causal sliding windows ``window=(w, 0)`` (row i sees keys i-w .. i) at each N, against the full causal
  call of the same N and against FlexAttention with the same sliding-window block mask.  Time per visible (query, key)
  pair is reported, so that a cost that grows with w (not with N) shows as a flat line.
- ``softcap`` / ``alibi``: the same call with ``softcap`` (30, Grok-1's value; Gemma 2's is 50) or ALiBi slopes,
  against the call without them and against FlexAttention's ``score_mod`` version.
- ``head_dims``: D = 192 with Dv = 128 (DeepSeek's MLA) beside D = 128, TFLOP/s.

attnzoo is timed on each backend of ``--impls`` (default: ``triton_2kernel`` and ``triton_atomic``, whose backward
on Hopper is the five-product kernel).  Shapes follow the grid: ``B = tokens / N`` (at least 1), ``H = width / D``.
attnzoo's calls run the stored or
heuristic configs, or with ``--autotune`` each key's timed winner; the configs that ran are printed at the end.
Times are ``triton.testing.do_bench`` medians after warm-up; forward and backward are timed separately (the
backward on saved o and lse, Flex's through ``torch.autograd.grad`` on a retained graph).  A case a backend does
not support is written with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import attnzoo

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _visible_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs a causal call with ``window=(window, 0)`` computes at Nq = Nk = n (None: full causal)."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    # rows 0 .. window see i + 1 keys; later rows see window + 1.
    return (window + 1) * (window + 2) // 2 + (n - window - 1) * (window + 1)


def _time_ms(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


class Flex:
    """FlexAttention compiled once; block masks and score mods built per case."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        torch._functorch.config.donated_buffer = False  # the timed backward re-runs one retained graph
        self.run = torch.compile(flex_attention, dynamic=False)

    @staticmethod
    def block_mask(n: int, window: int | None, device):
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx
            if window is not None:
                visible = visible & (q_idx - kv_idx <= window)
            return visible

        return create_block_mask(mask_mod, None, None, n, n, device=device)


def _attnzoo_times(name: str, q, k, v, do, **kw) -> tuple[float, float]:
    backend = attnzoo.get(name)
    o, lse = backend.forward(q, k, v, **kw)
    backend.backward(do, q, k, v, o, lse, **kw)  # compile (and read or pick the configs) outside the timing
    fwd = _time_ms(lambda: backend.forward(q, k, v, **kw))
    bwd = _time_ms(lambda: backend.backward(do, q, k, v, o, lse, **kw))
    return fwd, bwd


def _flex_times(flex: Flex, q, k, v, do, block_mask=None, score_mod=None) -> tuple[float, float]:
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    kw = dict(block_mask=block_mask, score_mod=score_mod, enable_gqa=q.shape[1] != k.shape[1])
    with torch.no_grad():
        flex.run(q, k, v, **kw)
    fwd = _time_ms(lambda: flex.run(q, k, v, **kw))
    out = flex.run(*leaves, **kw)
    torch.autograd.grad(out, leaves, do, retain_graph=True)
    bwd = _time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return fwd, bwd


def _softcap_mod(cap: float):
    """FlexAttention's ``score_mod`` of a logit soft cap."""

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


def _alibi_mod(slopes: torch.Tensor):
    """FlexAttention's ``score_mod`` of ALiBi with per-head ``slopes`` (Nq = Nk, so i' = i)."""

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return alibi_mod


def _inputs(batch, heads, n, d, dv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    return randn(batch, heads, n, d), randn(batch, heads, n, d), randn(batch, heads, n, dv), randn(batch, heads, n, dv)


def _measure(rows, table, impl, case, times_of, *args, **kwargs):
    """Time ``times_of(*args, **kwargs)`` -> (forward ms, backward ms) and append the row (with the error, if any)."""
    try:
        fwd, bwd = times_of(*args, **kwargs)
        status = "ok"
    except Exception as error:  # a row records what happened: unsupported, out of memory, a failure
        fwd = bwd = float("nan")
        status = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    rows.append({"table": table, "impl": impl, **case, "fwd_ms": fwd, "bwd_ms": bwd, "status": status})
    print(f"{table:<9} {impl:<16} {case} fwd {fwd:.3f} ms bwd {bwd:.3f} ms {status if status != 'ok' else ''}")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> list[dict]:
    flex = Flex()
    rows: list[dict] = []
    for dtype_name in args.dtype.split(","):
        dtype = DTYPES[dtype_name]
        d = 128
        heads = max(1, args.width // d)
        for n in args.N:
            batch = max(1, args.tokens // n)
            q, k, v, do = _inputs(batch, heads, n, d, d, dtype, seed=n)
            for window in [None, *args.windows]:
                if window is not None and window >= n:
                    continue
                case = dict(dtype=dtype_name, B=batch, H=heads, N=n, D=d, Dv=d, window=window or "",
                            pairs=batch * heads * _visible_pairs(n, window))  # fmt: skip
                kw = dict(causal=True) if window is None else dict(causal=True, window=(window, 0))
                for impl in args.impls:
                    _measure(rows, "window", impl, case, _attnzoo_times, impl, q, k, v, do, **kw)
                mask = Flex.block_mask(n, window, q.device)
                _measure(rows, "window", "flex_attention", case, _flex_times, flex, q, k, v, do, mask)
            if n in args.modifier_N:
                full = Flex.block_mask(n, None, q.device)
                slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device="cuda")
                cap = 30.0
                softcap_mod, alibi_mod = _softcap_mod(cap), _alibi_mod(slopes)

                base = dict(dtype=dtype_name, B=batch, H=heads, N=n, D=d, Dv=d, window="", pairs=0)
                for table, kw, mod in (
                    ("plain", {}, None),
                    ("softcap", dict(softcap=cap), softcap_mod),
                    ("alibi", dict(alibi_slopes=slopes), alibi_mod),
                ):
                    for impl in args.impls:
                        _measure(rows, table, impl, base, _attnzoo_times, impl, q, k, v, do, causal=True, **kw)
                    _measure(rows, table, "flex_attention", base, _flex_times, flex, q, k, v, do, full, mod)
            del q, k, v, do
            torch.cuda.empty_cache()
        for d, dv in ((128, 128), (192, 128)) if args.head_dim_N > 0 else ():
            n = args.head_dim_N
            batch, heads = max(1, args.tokens // n), 16
            q, k, v, do = _inputs(batch, heads, n, d, dv, dtype, seed=d)
            case = dict(dtype=dtype_name, B=batch, H=heads, N=n, D=d, Dv=dv, window="", pairs=0)
            for causal in (False, True):
                table = "head_dims" + ("_causal" if causal else "")
                for impl in args.impls:
                    _measure(rows, table, impl, case, _attnzoo_times, impl, q, k, v, do, causal=causal)
            del q, k, v, do
    return rows


def tflops(row: dict, which: str) -> float:
    """Useful TFLOP/s: 2 products of 2 * pairs * D (QK^T with D, PV with Dv); backward 2.5x the forward's."""
    b, h, n = int(row["B"]), int(row["H"]), int(row["N"])
    pairs = int(row["pairs"]) or (b * h * n * (n + 1) // 2 if "causal" in row["table"] else b * h * n * n)
    flops = 2 * pairs * (int(row["D"]) + int(row["Dv"]))
    if which == "bwd":
        flops *= 2.5
    ms = float(row[f"{which}_ms"])
    return flops / (ms * 1e-3) / 1e12 if ms == ms and ms > 0 else float("nan")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window_rows = [r for r in rows if r["table"] == "window" and r["status"] == "ok"]
    cases = sorted({(r["dtype"], r["N"]) for r in window_rows})
    ours = sorted({r["impl"] for r in window_rows} - {"flex_attention"})
    styles = {impl: ("-o", "-.^", ":v", "-x", "-d")[i % 5] for i, impl in enumerate(ours)} | {"flex_attention": "--s"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, which in zip(axes, ("fwd", "bwd"), strict=True):
        for dtype, n in cases:
            for impl, style in styles.items():
                points = [r for r in window_rows if (r["dtype"], r["N"], r["impl"]) == (dtype, n, impl) and r["window"]]
                points.sort(key=lambda r: int(r["window"]))
                if points:
                    ax.plot([int(r["window"]) for r in points], [float(r[f"{which}_ms"]) for r in points], style,
                            label=f"{impl} {dtype} N={n}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("window w (causal, window=(w, 0))")
        ax.set_ylabel(f"{which} time (ms)")
        ax.set_title(f"sliding-window attention, D=128: {which}")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(rows: list[dict]) -> list[str]:
    """The issue's ratios: per (dtype, N, window) attnzoo over flex and attnzoo's time per pair over full causal's."""
    ok = {(r["table"], r["impl"], r["dtype"], r["N"], str(r["window"])): r for r in rows if r["status"] == "ok"}
    lines = ["table impl dtype N window | flex/ours fwd bwd | per-pair time / full causal's (ours) fwd bwd"]
    for (table, impl, dtype, n, window), row in sorted(ok.items(), key=lambda kv: str(kv[0])):
        if impl == "flex_attention" or table != "window":
            continue
        flex = ok.get((table, "flex_attention", dtype, n, window))
        full = ok.get((table, impl, dtype, n, ""))
        cells = []
        for which in ("fwd", "bwd"):
            cells.append(f"{float(flex[f'{which}_ms']) / float(row[f'{which}_ms']):.2f}" if flex else "-")
        for which in ("fwd", "bwd"):
            if full:
                per_pair = float(row[f"{which}_ms"]) / int(row["pairs"])
                cells.append(f"{per_pair / (float(full[f'{which}_ms']) / int(full['pairs'])):.2f}")
            else:
                cells.append("-")
        lines.append(f"window {impl} {dtype} {n} {window or 'full'} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]}")
    for table in ("softcap", "alibi"):
        for (t, impl, dtype, n, window), row in sorted(ok.items(), key=lambda kv: str(kv[0])):
            if t != table or impl == "flex_attention":
                continue
            plain, flex = ok.get(("plain", impl, dtype, n, window)), ok.get((table, "flex_attention", dtype, n, window))
            over = [float(row[f"{w}_ms"]) / float(plain[f"{w}_ms"]) if plain else math.nan for w in ("fwd", "bwd")]
            vs = [float(flex[f"{w}_ms"]) / float(row[f"{w}_ms"]) if flex else math.nan for w in ("fwd", "bwd")]
            lines.append(
                f"{table} {impl} {dtype} {n} | cost over plain fwd {over[0]:.3f} bwd {over[1]:.3f} | "
                f"flex/ours fwd {vs[0]:.2f} bwd {vs[1]:.2f}"
            )
    for row in rows:
        if row["table"].startswith("head_dims") and row["status"] == "ok":
            lines.append(
                f"{row['table']} {row['impl']} {row['dtype']} D={row['D']} Dv={row['Dv']} N={row['N']}: "
                f"fwd {tflops(row, 'fwd'):.0f} bwd {tflops(row, 'bwd'):.0f} TFLOP/s"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnzoo.bench.modifiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16,fp16")
    p.add_argument("--impls", default="triton_2kernel,triton_atomic", help="attnzoo backends to time")
    p.add_argument("--N", default="4096,8192,16384,32768")
    p.add_argument("--windows", default="256,1024,4096")
    p.add_argument("--modifier-N", default="4096,8192", help="N of the softcap/ALiBi tables")
    p.add_argument("--head-dim-N", type=int, default=8192, help="N of the D=192/Dv=128 table (0: no such table)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--out", default="bench/results/h100_modifiers.csv")
    p.add_argument("--plot", default=None, help="PNG of time against window (default: the CSV's name, .png)")
    p.add_argument("--autotune", action="store_true", help="time every candidate config of each new key first")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("python -m attnzoo.bench.modifiers: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.N = [int(x) for x in args.N.split(",")]
    args.impls = args.impls.split(",")
    args.windows = [int(x) for x in args.windows.split(",")]
    args.modifier_N = [int(x) for x in args.modifier_N.split(",")]
    from attnzoo.kernels import tuning

    with tuning.autotuning(True) if args.autotune else contextlib.nullcontext():
        rows = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, Path(args.plot) if args.plot else out.with_suffix(".png"))
    print("\n".join(summary(rows)))
    for key, (cfg, source) in tuning.chosen_configs().items():
        print(f"[config] {key}: {cfg} ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
