"""Score terms above D = 128: Gemma-2's attention shape (D = 256, 16 query heads on 8 K/V heads, a soft cap of 50,
a 4096-key causal sliding window on its local layers) and ALiBi, forward and backward, through the public backend
API, beside the plain causal call of the same shape, FlexAttention's ``score_mod`` / block-mask versions and SDPA's
cuDNN (plain causal only: it has no soft cap).

Run once per tree and alternate the processes (``--label`` names the tree in the CSV); ``--peers`` adds the Flex
and cuDNN rows (one process is enough for them).  Each row is one ``triton.testing.do_bench`` median after warm-up.

    PYTHONPATH=<tree> python3 bench/wide_modifiers_ab.py --label after --peers --out $OUT/after_1.csv
    python3 bench/wide_modifiers_ab.py --combine before_1.csv after_1.csv ... --out bench/results/<name>.csv

Useful FLOPs as in ``attnzoo.bench.modifiers``: the forward ``2 * pairs * (D + Dv)`` over the visible (query, key)
pairs, the backward 2.5x that.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from attnzoo.bench.modifiers import (
    Flex,
    _alibi_mod,
    _attnzoo_times,
    _flex_times,
    _softcap_mod,
    _time_ms,
    _visible_pairs,
)

HEADS, KV_HEADS, TOKENS, CAP, WINDOW = 16, 8, 16384, 50.0, 4096


def _cudnn(q, k, v, do) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    leaves = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        run = lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)  # noqa: E731
        fwd = _time_ms(lambda: run(*leaves))
        out = run(*leaves)
        torch.autograd.grad(out, leaves, do, retain_graph=True)
        return fwd, _time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))


def _time_shape(n: int, label: str, flex: Flex | None) -> list[dict]:
    """The rows of one sequence length: each case on attnzoo (and, given ``flex``, on the peers)."""
    dtype, d = torch.bfloat16, 256
    batch = max(1, TOKENS // n)
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, do = (torch.randn(batch, HEADS, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, KV_HEADS, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], device="cuda")
    cases = {
        "plain": (dict(causal=True), None, None),
        "softcap": (dict(causal=True, softcap=CAP), None, "softcap"),
        "softcap_window": (dict(causal=True, softcap=CAP, window=(WINDOW, 0)), WINDOW, "softcap"),
        "alibi": (dict(causal=True, alibi_slopes=slopes), None, "alibi"),
    }
    score_mods = {None: None, "softcap": _softcap_mod(CAP), "alibi": _alibi_mod(slopes)}

    rows = []
    for case, (kw, window, term) in cases.items():
        impls = {f"attnzoo_{label}": lambda kw=kw: _attnzoo_times("triton_2kernel", q, k, v, do, **kw)}
        if flex is not None:
            impls["flex_attention"] = lambda window=window, term=term: _flex_times(
                flex, q, k, v, do, Flex.block_mask(n, window, q.device), score_mods[term]
            )  # fmt: skip
            if case == "plain":
                impls["sdpa_cudnn"] = lambda: _cudnn(q, k, v, do)
        for impl, times in impls.items():
            try:
                fwd, bwd = times()
                status = "ok"
            except Exception as error:  # the row records what happened
                fwd = bwd = float("nan")
                status = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            flops = 2 * batch * HEADS * _visible_pairs(n, window) * 2 * d
            rows.append(dict(
                impl=impl, case=case, dtype="bf16", B=batch, H=HEADS, Hkv=KV_HEADS, N=n, D=d, fwd_ms=fwd,
                bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9, bwd_tflops=2.5 * flops / bwd / 1e9, status=status,
            ))  # fmt: skip
            print(f"{impl:<18} {case:<15} N={n}: fwd {fwd:.3f} ms ({rows[-1]['fwd_tflops']:.0f} TFLOP/s), "
                  f"bwd {bwd:.3f} ms ({rows[-1]['bwd_tflops']:.0f} TFLOP/s) {status}", flush=True)  # fmt: skip
    return rows


def _plot(med: dict, path: str) -> None:
    """Bars of the median TFLOP/s, forward and backward, per (case, N) and impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [
        i for i in ("attnzoo_before", "attnzoo_after", "flex_attention", "sdpa_cudnn") if any(k[0] == i for k in med)
    ]
    groups = sorted({(case, n) for _, case, n in med}, key=lambda g: (g[1], g[0]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(impls)
    for ax, (column, which) in zip(axes, ((2, "forward"), (3, "backward")), strict=True):
        for i, impl in enumerate(impls):
            values = [med.get((impl, case, n), [0.0] * 4)[column] for case, n in groups]
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=impl)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{case}\nN={n}" for case, n in groups], fontsize=7)
        ax.set_ylabel("TFLOP/s (useful)")
        ax.set_title(f"bf16 D=256, H=16/8, causal: {which}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def combine(paths: list[str], out: str) -> list[str]:
    """The processes' CSVs as one (a ``round`` column: the file's index among those of its impl) -> summary lines:
    per (case, N) the medians over rounds, the tree after over the tree before, the cost of the case over the plain
    call, and FlexAttention's time over ours."""
    rows, seen = [], {}
    for path in paths:
        with open(path) as fh:
            for row in csv.DictReader(fh):
                key = (row["impl"], row["case"], row["N"])
                seen[key] = seen.get(key, 0) + 1
                rows.append({**row, "round": seen[key]})
    with open(out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    # Per (impl, case, N): median forward and backward ms, and TFLOP/s (the cost of a case over the plain call is
    # taken per visible pair, which a window changes).
    stats: dict[tuple, list[tuple[float, ...]]] = {}
    for row in rows:
        values = tuple(float(row[c]) for c in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops"))
        stats.setdefault((row["impl"], row["case"], int(row["N"])), []).append(values)
    med = {key: [statistics.median(v[i] for v in vs) for i in range(4)] for key, vs in stats.items()}
    lines = ["case N | after/before speed fwd bwd | time per pair over plain's (after) fwd bwd | flex/after fwd bwd"]
    for (impl, case, n), ours in sorted(med.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if impl != "attnzoo_after":
            continue
        before, plain = med.get(("attnzoo_before", case, n)), med.get(("attnzoo_after", "plain", n))
        flex = med.get(("flex_attention", case, n))
        cells = [
            f"{before[0] / ours[0]:.2f} {before[1] / ours[1]:.2f}" if before else "- -",
            f"{plain[2] / ours[2]:.2f} {plain[3] / ours[3]:.2f}" if plain else "- -",
            f"{flex[0] / ours[0]:.2f} {flex[1] / ours[1]:.2f}" if flex else "- -",
        ]
        lines.append(f"{case} {n} | {' | '.join(cells)}")
    _plot(med, out.rsplit(".", 1)[0] + ".png")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", help="the tree's name in the CSV (e.g. before / after)")
    parser.add_argument("--peers", action="store_true", help="also time FlexAttention and SDPA's cuDNN")
    parser.add_argument("--N", default="4096,8192")
    parser.add_argument("--combine", nargs="+", metavar="CSV", help="no timing: merge these runs' CSVs into --out")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.combine:
        print("\n".join(combine(args.combine, args.out)))
        return
    if not args.label:
        parser.error("--label is required when timing")
    flex = Flex() if args.peers else None
    rows = []
    for n in (int(x) for x in args.N.split(",")):
        rows += _time_shape(n, args.label, flex)
        torch.cuda.empty_cache()
    from attnzoo.kernels import tuning

    for key, (cfg, source) in tuning.chosen_configs().items():
        print(f"[config] {key}: {cfg} ({source})")
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
