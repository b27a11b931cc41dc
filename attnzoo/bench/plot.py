"""``python -m attnzoo plot``: the benchmark figures and the README tables, from a bench CSV.

Six figure kinds, one PNG per (dtype, D, causal) each: forward latency vs N, train latency vs N, the train
breakdown into forward and backward, tokens/s vs N, speedup vs SDPA flash and cuDNN, and peak memory vs N; plus a
one-page speedup summary.  Every figure is labelled with the GPU, driver and versions read from the CSV.
``--readme`` prints (or ``--readme-out`` writes) the markdown performance section instead.

matplotlib is imported lazily with the Agg backend (the ``plot`` extra), so that ``bench`` needs none of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

from ..cli import positive_int
from .machine import machine_tag
from .schema import STATUS_OK, read_csv, status_kind

FIGURE_KINDS = ("fwd_latency", "train_latency", "train_breakdown", "tokens_per_s", "speedup", "peak_memory")
# Our impls: these labels, and any variant of these backends (``name:key=value``, see attnzoo.bench.impls).
OURS = ("triton_2kernel", "triton_atomic", "triton_atomic_recompute")
REFERENCES = ("sdpa_flash", "sdpa_cudnn", "flex_attention")


def _is_ours(impl: str) -> bool:
    return impl.split(":")[0] in OURS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fill_missing_speedups(rows: list[dict]) -> None:
    """Recompute speedups where the CSV has none (a run killed before its final rewrite)."""
    if any(r.get("speedup_vs_sdpa_flash") is not None for r in rows):
        return
    from .run import fill_speedups

    fill_speedups(rows)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if status_kind(r["status"]) == STATUS_OK]


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows per (dtype, D, causal), in first-seen order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["dtype"], row["D"], row["causal"])].append(row)
    return groups


def _impl_order(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for row in rows:
        if row["impl"] not in seen:
            seen.append(row["impl"])
    return seen


def _colors(impls: list[str]) -> dict[str, tuple]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    return {impl: cmap(i % cmap.N) for i, impl in enumerate(impls)}


def _caption(rows: list[dict]) -> str:
    r = rows[0]
    sm = f", sm {r['gpu_sm']}" if r.get("gpu_sm") else ""
    driver = f", driver {r['driver']}" if r.get("driver") else ""
    return f"{r['gpu_name']}{sm}{driver}; torch {r['torch_version']}, triton {r['triton_version']}"


def _group_title(kind: str, key: tuple, rows: list[dict]) -> str:
    dtype, D, causal = key
    shape = f"{dtype}, D={D}, {'causal' if causal else 'non-causal'}"
    r = rows[0]
    budget = f"B*N = {r['B'] * r['N']}, H = {r['H']}" if r.get("B") else ""
    return f"{kind.replace('_', ' ')}: {shape} ({budget})\n{_caption(rows)}"


def _series(rows: list[dict], mode: str, impl: str, column: str) -> tuple[list[int], list[float]]:
    points = sorted((r["N"], r[column]) for r in rows if r["mode"] == mode and r["impl"] == impl)
    points = [(n, y) for n, y in points if y is not None]
    return [n for n, _ in points], [y for _, y in points]


def _line_axes(ax, ylabel: str, log_y: bool = True) -> None:
    ax.set_xscale("log", base=2)
    Ns = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata() if x >= 2})  # data lines, not axhline
    if Ns:
        ax.set_xticks(Ns, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in Ns])
        ax.xaxis.set_minor_locator(_pyplot().NullLocator())
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _lines(ax, rows, impls, colors, mode, column, style="-o") -> None:
    for impl in impls:
        xs, ys = _series(rows, mode, impl, column)
        if xs:
            ax.plot(xs, ys, style, color=colors[impl], label=impl if style.startswith("-o") else None, markersize=4)


def _figure_line(plt, rows, impls, colors, title, panels):
    """A figure of one or more line panels: panels = [(subtitle, mode, column, ylabel, log_y)]."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (subtitle, mode, column, ylabel, log_y) in zip(axes[0], panels, strict=True):
        _lines(ax, rows, impls, colors, mode, column)
        _line_axes(ax, ylabel, log_y)
        ax.set_title(subtitle, fontsize=10)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _figure_breakdown(plt, rows, impls, colors, title):
    """One panel per N (linear ms): a stacked bar per impl, forward below, backward above (hatched)."""
    train = [r for r in rows if r["mode"] == "train"]
    Ns = sorted({r["N"] for r in train}) or [0]
    fig, axes = plt.subplots(1, len(Ns), figsize=(2.6 * len(Ns) + 1.5, 4.8), squeeze=False)
    for ax, N in zip(axes[0], Ns, strict=True):
        by_impl = {r["impl"]: r for r in train if r["N"] == N}
        present = [i for i in impls if i in by_impl]
        xs = list(range(len(present)))
        fwd = [by_impl[i]["fwd_ms"] for i in present]
        bwd = [by_impl[i]["bwd_ms"] for i in present]
        ax.bar(xs, fwd, 0.8, color=[colors[i] for i in present])
        ax.bar(xs, bwd, 0.8, bottom=fwd, color=[colors[i] for i in present], alpha=0.5, hatch="//")
        ax.set_xticks(xs, present, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"N = {N}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("ms (solid: forward, hatched: backward)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _figure_speedup(plt, rows, impls, colors, title):
    """Speedup of each impl over SDPA flash (left) and cuDNN (right); solid: train, dashed: forward only."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for ax, (column, ref) in zip(
        axes, (("speedup_vs_sdpa_flash", "SDPA flash (FA2)"), ("speedup_vs_sdpa_cudnn", "SDPA cuDNN")), strict=True
    ):
        _lines(ax, rows, impls, colors, "train", column, "-o")
        _lines(ax, rows, impls, colors, "fwd", column, "--")
        _line_axes(ax, f"speedup vs {ref} (time ratio)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"vs {ref}; solid: train (fwd+bwd), dashed: forward", fontsize=10)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def figures_for_group(key: tuple, rows: list[dict], impls: list[str], colors: dict) -> dict[str, object]:
    """The six figures of one (dtype, D, causal) group, by kind."""
    plt = _pyplot()
    ok = _ok(rows)
    present = [i for i in impls if any(r["impl"] == i for r in ok)]
    return {
        "fwd_latency": _figure_line(
            plt, ok, present, colors, _group_title("forward latency", key, rows),
            [("forward", "fwd", "fwd_ms", "ms (median)", True)],
        ),
        "train_latency": _figure_line(
            plt, ok, present, colors, _group_title("train latency", key, rows),
            [("forward + backward", "train", "total_ms", "ms (median fwd + median bwd)", True)],
        ),
        "train_breakdown": _figure_breakdown(plt, ok, present, colors, _group_title("train breakdown", key, rows)),
        "tokens_per_s": _figure_line(
            plt, ok, present, colors, _group_title("throughput", key, rows),
            [("forward", "fwd", "tokens_per_s", "tokens/s", True),
             ("train (fwd + bwd)", "train", "tokens_per_s", "tokens/s", True)],
        ),
        "speedup": _figure_speedup(plt, ok, present, colors, _group_title("speedup", key, rows)),
        "peak_memory": _figure_line(
            plt, ok, present, colors, _group_title("peak memory", key, rows),
            [("forward (inputs + outputs + workspace)", "fwd", "peak_mem_mb", "MB (allocator peak)", True),
             ("train step (incl. dO and gradients)", "train", "peak_mem_mb", "MB (allocator peak)", True)],
        ),
    }  # fmt: skip


def figure_speedup_summary(rows: list[dict], impls: list[str], colors: dict):
    """One page: train speedup vs SDPA flash (solid) and cuDNN (dotted) of our Triton impls, per group."""
    plt = _pyplot()
    with_speedups = [r for r in _ok(rows) if r["mode"] == "train" and r["speedup_vs_sdpa_flash"] is not None]
    groups = _groups(with_speedups)
    ours = [i for i in impls if _is_ours(i)] or [i for i in impls if i not in REFERENCES]
    cols = min(4, max(len(groups), 1))
    nrows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False, sharey=True)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, ((dtype, D, causal), group) in zip(axes.flat, groups.items(), strict=False):
        for impl in ours:
            for column, style in (("speedup_vs_sdpa_flash", "-o"), ("speedup_vs_sdpa_cudnn", ":s")):
                xs, ys = _series(group, "train", impl, column)
                label = f"{impl} vs {column.removeprefix('speedup_vs_')}"
                ax.plot(xs, ys, style, color=colors[impl], markersize=3, label=label)
        _line_axes(ax, "speedup (train)", log_y=False)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{dtype}, D={D}, {'causal' if causal else 'non-causal'}", fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    fig.suptitle(f"train (fwd + bwd) speedup over SDPA flash (solid) and cuDNN (dotted)\n{_caption(rows)}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def write_figures(rows: list[dict], out_dir: Path, prefix: str, dpi: int = 90) -> list[Path]:
    """Every figure as PNG under ``out_dir``: ``{prefix}_{kind}_{dtype}_d{D}_{causal|full}.png``."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    impls = _impl_order(rows)
    colors = _colors(impls)
    written = []
    for key, group in _groups(rows).items():
        if not _ok(group):  # a group that did not run at all (cut by --time-budget-s, say) gets no figures
            continue
        dtype, D, causal = key
        for kind, fig in figures_for_group(key, group, impls, colors).items():
            path = out_dir / f"{prefix}_{kind}_{dtype}_d{D}_{'causal' if causal else 'full'}.png"
            fig.savefig(path, dpi=dpi)
            plt.close(fig)
            written.append(path)
    if has_speedups(rows):  # a CPU run has no SDPA flash or cuDNN row to compare with
        fig = figure_speedup_summary(rows, impls, colors)
        path = out_dir / f"{prefix}_speedup_summary.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    return written


def has_speedups(rows: list[dict]) -> bool:
    """Whether any measured train row has a speedup over SDPA flash (what the summary figure draws)."""
    return any(r["mode"] == "train" and r["speedup_vs_sdpa_flash"] is not None for r in _ok(rows))


# -- README tables ------------------------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pair(row_fwd: dict | None, row_train: dict | None) -> str:
    """ "fwd/bwd" TFLOP/s as in SPEC.md's anchor table; a side that did not run shows its status word (oom, ...)."""

    def side(row: dict | None, column: str) -> str:
        if row is None:
            return "-"
        return _fmt(row[column]) if row["status"] == STATUS_OK else status_kind(row["status"])

    if row_fwd is None and row_train is None:
        return "-"
    return f"{side(row_fwd, 'tflops_fwd')}/{side(row_train, 'tflops_bwd')}"


def readme_table(rows: list[dict], Ns: list[int], impls: list[str]) -> str:
    """Markdown: one row per (dtype, D, causal, N), fwd/bwd TFLOP/s per impl, and triton_2kernel's train ratios."""
    index = {(r["dtype"], r["D"], r["causal"], r["N"], r["mode"], r["impl"]): r for r in rows}
    present = [i for i in impls if any(r["impl"] == i for r in rows)]
    head = ["dtype, D, causal", "N", *[f"{i} fwd/bwd" for i in present]]
    ratio_impl = next((i for i in OURS if i in present), None)
    if ratio_impl:
        head += [f"{ratio_impl} train speedup vs flash", "vs cuDNN"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for dtype, D, causal in _groups(rows):
        for N in Ns:
            cases = [index.get((dtype, D, causal, N, m, i)) for m in ("fwd", "train") for i in present]
            if not any(r is not None and r["status"] == STATUS_OK for r in cases):
                continue  # nothing of this row ran (e.g. cut by --time-budget-s): no row of dashes
            cells = [f"{dtype}, {D}, {'yes' if causal else 'no'}", str(N)]
            for impl in present:
                fwd, train = (index.get((dtype, D, causal, N, mode, impl)) for mode in ("fwd", "train"))
                cells.append(_pair(fwd, train))
            if ratio_impl:
                train = index.get((dtype, D, causal, N, "train", ratio_impl))
                ok = train is not None and train["status"] == STATUS_OK
                for column in ("speedup_vs_sdpa_flash", "speedup_vs_sdpa_cudnn"):
                    value = train[column] if ok else None
                    cells.append("-" if value is None else f"{value:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_section(rows: list[dict], Ns: list[int], figure: str, csv_name: str) -> str:
    """The markdown performance section: caption, how it was counted, the table, the speedup figure (``figure``:
    its path relative to the markdown file)."""
    present = _impl_order(rows)
    variants = [i for i in present if _is_ours(i) and i not in OURS]
    impls = [i for i in (*OURS, *variants, *REFERENCES, "sdpa_efficient", "sdpa_math") if i in present]
    r = rows[0]
    return "\n".join(
        [
            "## Performance",
            "",
            f"Measured on {_caption(rows)} with `python -m attnzoo bench` ({csv_name}).",
            f"TFLOP/s as in SPEC.md: 4·B·H·N²·D forward (half when causal), backward 2.5x that and timed alone; "
            f"B·N = {r['B'] * r['N']} tokens, H·D = {r['H'] * r['D']}. Medians of CUDA-event timings after warm-up. "
            "Cells are forward/backward TFLOP/s; the ratios are SDPA's train time (fwd + bwd) over ours "
            "(above 1: ours is faster).",
            "",
            readme_table(rows, Ns, impls),
            "",
            f"![train speedup over SDPA]({figure})",
            "",
        ]
    )


BEGIN_MARK = "<!-- begin: generated by python -m attnzoo plot --readme-out; edits inside are overwritten -->"
END_MARK = "<!-- end: generated -->"


def write_generated_block(path: Path, text: str) -> None:
    """Put ``text`` between the markers of ``path`` (the rest of the file, hand-written notes, stays as it is);
    a file without markers gets the block appended."""
    block = f"{BEGIN_MARK}\n{text.rstrip()}\n{END_MARK}"
    old = path.read_text() if path.exists() else ""
    if BEGIN_MARK in old and END_MARK in old:
        head, rest = old.split(BEGIN_MARK, 1)
        new = head + block + rest.split(END_MARK, 1)[1]
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block + "\n"
    path.write_text(new)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnzoo plot", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", help="CSVs written by python -m attnzoo bench (rows are concatenated)")
    p.add_argument("--out-dir", default=None, help="where the PNGs go (default: the CSV's folder)")
    p.add_argument("--prefix", default=None, help="file-name prefix (default: the machine tag, e.g. h100)")
    p.add_argument("--dpi", type=positive_int, default=90, help="resolution of the PNGs")
    p.add_argument("--readme", action="store_true", help="print the markdown performance section, draw nothing")
    p.add_argument("--readme-out", default=None, help="write the markdown section to this file (draws nothing)")
    p.add_argument("--readme-N", default="2048,16384", help="sequence lengths of the README table")
    p.add_argument("--io-csv", default=None, help="with --readme: append the DRAM-bytes table of an io measure CSV")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    csv_paths = [Path(p) for p in args.csv]
    for path in csv_paths:
        if not path.is_file():
            parser.error(f"{path}: no such file")
    try:
        rows = [row for path in csv_paths for row in read_csv(path)]
    except (KeyError, ValueError) as exc:
        parser.error(f"{', '.join(args.csv)} is not a CSV of python -m attnzoo bench ({type(exc).__name__}: {exc})")
    missing = [c for c in ("mode", "impl", "N", "D", "status") if rows and c not in rows[0]]
    if missing:
        parser.error(f"{', '.join(args.csv)} is not a CSV of python -m attnzoo bench (no column {', '.join(missing)})")
    if not rows:
        print(f"{', '.join(args.csv)} has no rows", file=sys.stderr)
        return 1
    fill_missing_speedups(rows)
    prefix = args.prefix or machine_tag(rows[0]["gpu_name"])
    out_dir = Path(args.out_dir) if args.out_dir else csv_paths[0].parent
    if args.readme or args.readme_out:
        try:
            Ns = [int(n) for n in args.readme_N.split(",") if n]
        except ValueError:
            parser.error(f"--readme-N must be a comma list of sequence lengths, got {args.readme_N!r}")
        # Links in the markdown are relative to the file it goes into (bench/README.md or the top-level README).
        markdown_dir = Path(args.readme_out).resolve().parent if args.readme_out else out_dir.resolve()
        figure = os.path.relpath(out_dir.resolve() / f"{prefix}_speedup_summary.png", markdown_dir)
        text = readme_section(rows, Ns, figure, ", ".join(p.name for p in csv_paths))
        if args.io_csv:
            from .io_plot import io_markdown, read_measure_csv

            figure_prefix = os.path.relpath(out_dir.resolve() / prefix, markdown_dir)
            text += "\n" + io_markdown(read_measure_csv(Path(args.io_csv)), Path(args.io_csv).name, figure_prefix)
        if args.readme_out:
            write_generated_block(Path(args.readme_out), text)
        else:
            print(text)
        return 0
    written = write_figures(rows, out_dir, prefix, args.dpi)
    print(f"wrote {len(written)} figures to {out_dir}", file=sys.stderr)
    if not has_speedups(rows):
        print("no speedup summary: no train row has a speedup over sdpa_flash (a CPU run, say)", file=sys.stderr)
    return 0
