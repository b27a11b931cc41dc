"""Figures of ``python -m attnzoo io plot``: the roofline, and measured DRAM bytes against the IO-complexity theory."""

from __future__ import annotations

import csv
from pathlib import Path

from .machine import machine_tag

_NUMERIC = {
    "B", "H", "N", "D", "kernels", "dram_read_bytes", "dram_write_bytes", "dram_bytes", "gpu_ms", "achieved_TBps",
    "achieved_TFLOPs", "arithmetic_intensity", "minimum_bytes", "standard_bytes", "standard_fp32_bytes",
    "flash1_bytes", "flash2_bytes", "measured_over_standard", "measured_over_standard_fp32", "measured_over_flash2",
    "copy_TBps", "matmul_TFLOPs",
}  # fmt: skip


def read_measure_csv(path: Path) -> list[dict]:
    """Rows of an ``io measure`` CSV, numbers as floats (empty cells as None)."""
    with path.open(newline="") as f:
        return [
            {k: (float(v) if v else None) if k in _NUMERIC else v for k, v in row.items()} for row in csv.DictReader(f)
        ]


def _caption(rows: list[dict]) -> str:
    r = rows[0]
    return f"{r['gpu_name']}, driver {r['driver']}; torch {r['torch_version']}, triton {r['triton_version']}"


def plot_io(csv_path: Path, out_dir: Path, prefix: str | None = None, dpi: int = 100) -> list[Path]:
    """Write ``{prefix}_roofline.png`` and ``{prefix}_io_bytes.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_measure_csv(csv_path)
    ok = [r for r in rows if r["status"] == "ok"]
    prefix = prefix or machine_tag(rows[0]["gpu_name"])
    out_dir.mkdir(parents=True, exist_ok=True)
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    cmap = plt.get_cmap("tab10")
    color = {impl: cmap(i) for i, impl in enumerate(impls)}
    marker = {"fwd": "o", "bwd": "s"}
    written = []

    # Roofline: achieved TFLOP/s against arithmetic intensity (useful FLOPs per DRAM byte), with the ceilings
    # measured in the same run.
    copy_tbps, mm_tflops = rows[0]["copy_TBps"], rows[0]["matmul_TFLOPs"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai_min = min([r["arithmetic_intensity"] for r in ok] + [1.0]) / 2
    ai_max = max([r["arithmetic_intensity"] for r in ok] + [1e4]) * 2
    ridge = mm_tflops / copy_tbps  # FLOP/byte where the two ceilings meet (TFLOP/s over TB/s)
    xs = [ai_min, ridge, ai_max]
    ax.plot(xs, [min(copy_tbps * x, mm_tflops) for x in xs], "k-", linewidth=1.2)
    ax.text(ai_min * 1.1, copy_tbps * ai_min * 1.3, f"copy {copy_tbps:.2f} TB/s", fontsize=8, rotation=0)
    ax.text(ridge * 1.2, mm_tflops * 1.08, f"bf16 matmul {mm_tflops:.0f} TFLOP/s", fontsize=8)
    for r in ok:
        ax.plot(r["arithmetic_intensity"], r["achieved_TFLOPs"], marker[r["pass"]], color=color[r["impl"]])
        ax.annotate(f"{int(r['N']) // 1024}k", (r["arithmetic_intensity"], r["achieved_TFLOPs"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")  # fmt: skip
    for impl in impls:
        ax.plot([], [], "o", color=color[impl], label=impl)
    ax.plot([], [], "ko", label="forward", fillstyle="none")
    ax.plot([], [], "ks", label="backward", fillstyle="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (useful FLOPs / DRAM byte, ncu)")
    ax.set_ylabel("achieved TFLOP/s (useful FLOPs / summed kernel time)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    r0 = rows[0]
    ax.set_title(
        f"roofline: {r0['dtype']}, D={int(r0['D'])}, B={int(r0['B'])}, H={int(r0['H'])}, labels = N\n{_caption(rows)}",
        fontsize=9,
    )
    fig.tight_layout()
    path = out_dir / f"{prefix}_roofline.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    written.append(path)

    # DRAM bytes against N, per pass, with the modelled lines.
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, pass_ in zip(axes, ("fwd", "bwd"), strict=True):
        columns = ("minimum_bytes", "standard_bytes", "standard_fp32_bytes", "flash1_bytes", "flash2_bytes")
        theory = sorted({(r["N"], *(r.get(c) for c in columns)) for r in rows if r["pass"] == pass_})
        if theory:
            Ns = [t[0] for t in theory]
            labels = ("minimum (inputs/outputs once)", "standard attention", "standard, float32 S/P (SDPA math)",
                      "FlashAttention Alg. 1 (M = 227 KB)", "FA2 order, 128-row tiles, no cache")  # fmt: skip
            styles = ("k:x", "k-x", "C7-x", "k--x", "k-.x")
            for j, (label, style) in enumerate(zip(labels, styles, strict=True)):
                if theory[0][j + 1] is not None:
                    ax.plot(Ns, [t[j + 1] for t in theory], style, linewidth=1, markersize=4, label=label)
        for impl in impls:
            pts = sorted((r["N"], r["dram_bytes"]) for r in ok if r["impl"] == impl and r["pass"] == pass_)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=color[impl], label=f"{impl} (ncu)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("DRAM bytes read + written")
        ax.set_title("forward" if pass_ == "fwd" else "backward", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"measured DRAM traffic vs IO-complexity theory\n{_caption(rows)}", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{prefix}_io_bytes.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    written.append(path)
    return written


def io_markdown(rows: list[dict], csv_name: str, figure_prefix: str) -> str:
    """Markdown: measured DRAM bytes per (impl, pass, N) beside the modelled ones, and the figures
    (``figure_prefix``: their path prefix relative to the markdown file, e.g. ``results/h100``)."""
    r0 = rows[0]
    head = [
        "impl", "pass", "N", "kernels", "DRAM read + write (MB)", "minimum", "standard fp16", "standard fp32",
        "FA1 Alg. 1", "FA2 order, no cache", "measured / standard", "TB/s", "TFLOP/s",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]

    def mb(x):
        return "-" if x is None else f"{x / 1e6:,.0f}"

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['pass']} | {int(r['N'])} | {r['status']} |" + " |" * (len(head) - 4))
            continue
        fp32 = r["impl"] == "sdpa_math" and r.get("standard_fp32_bytes") is not None  # SDPA math computes in fp32
        std = r["standard_fp32_bytes"] if fp32 else r["standard_bytes"]
        cells = [
            r["impl"], r["pass"], str(int(r["N"])), str(int(r["kernels"])),
            f"{mb(r['dram_read_bytes'])} + {mb(r['dram_write_bytes'])}", mb(r["minimum_bytes"]),
            mb(r["standard_bytes"]), mb(r.get("standard_fp32_bytes")), mb(r["flash1_bytes"]), mb(r["flash2_bytes"]),
            f"{r['dram_bytes'] / std:.3g}" + (" (fp32)" if fp32 else ""),
            f"{r['achieved_TBps']:.2f}", f"{r['achieved_TFLOPs']:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [
            "## HBM traffic: measured against IO complexity",
            "",
            f"DRAM bytes read + written, summed over the kernels of one call, from Nsight Compute "
            f"(`ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum`, "
            f"caches flushed before each kernel) with `python -m attnzoo io measure` ({csv_name}); "
            f"{r0['dtype']}, D={int(r0['D'])}, B={int(r0['B'])}, H={int(r0['H'])}, non-causal. "
            "Modelled columns from `attnzoo/bench/io_theory.py` (MB). Ceilings measured in the same run: "
            f"copy {r0['copy_TBps']:.2f} TB/s, bf16 matmul {r0['matmul_TFLOPs']:.0f} TFLOP/s.",
            "",
            *lines,
            "",
            f"![roofline]({figure_prefix}_roofline.png) ![bytes vs theory]({figure_prefix}_io_bytes.png)",
            "",
        ]
    )
