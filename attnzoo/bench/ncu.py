"""Nsight Compute (ncu) measurements of DRAM traffic: the command line, and parsing its CSV.

Each measurement profiles one small driver process (``python -m attnzoo io target ...``) that warms up outside the
profiled range and brackets exactly one forward or one backward with ``cudaProfilerStart``/``Stop``
(``--profile-from-start off``), so that the sums over the profiled kernels are the bytes of that one call.
ncu flushes the caches before each kernel replay by default (``--cache-control all``), so every kernel starts with
a cold L2.  ``--clock-control none`` leaves the GPU clocks as they are (the lent machines need it).
"""

from __future__ import annotations

import csv
import io
import shutil
from dataclasses import dataclass

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")

_UNIT_SCALE = {
    "byte": 1.0,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "kibyte": 2.0**10,
    "mibyte": 2.0**20,
    "gibyte": 2.0**30,
    "nsecond": 1e-9,
    "ns": 1e-9,
    "usecond": 1e-6,
    "us": 1e-6,
    "msecond": 1e-3,
    "ms": 1e-3,
    "second": 1.0,
    "s": 1.0,
    "": 1.0,
}


def ncu_command(log_file: str, target: list[str], ncu: str = "ncu") -> list[str]:
    """The ncu command line that profiles ``target`` and writes its CSV to ``log_file``."""
    return [
        ncu,
        "--target-processes",
        "all",
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--metrics",
        ",".join(METRICS),
        "--csv",
        "--print-units",
        "base",
        "--log-file",
        log_file,
        *target,
    ]


def find_ncu() -> str | None:
    """Path of the ncu binary, or None."""
    for candidate in ("ncu", "/usr/local/cuda/bin/ncu"):
        path = shutil.which(candidate)
        if path:
            return path
    return None


def _number(text: str) -> float:
    """A metric value as ncu prints it ("1,234,567.5" in the details page, "n/a" when missing)."""
    text = text.strip().replace(",", "")
    return float(text) if text and text.lower() != "n/a" else float("nan")


@dataclass
class KernelMetrics:
    """One profiled kernel launch: name and metrics in base units (bytes, seconds)."""

    kernel: str
    values: dict[str, float]


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """Parse ncu's ``--csv`` output, in either page layout, into one entry per kernel launch.

    * details page (the default): one line per (kernel, metric) with "Metric Name", "Metric Unit", "Metric Value".
    * raw page (``--page raw``): one line per kernel with a column per metric, and a units line under the header.

    Lines that are not CSV records (``==PROF==`` messages, the program's own output) are ignored.
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    records = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = records[0], records[1:]
    col = {name: i for i, name in enumerate(header)}
    kernels: dict[str, KernelMetrics] = {}
    order: list[str] = []
    if "Metric Name" in col:
        for rec in body:
            launch_id = rec[col["ID"]]
            if launch_id not in kernels:
                kernels[launch_id] = KernelMetrics(rec[col["Kernel Name"]], {})
                order.append(launch_id)
            unit = rec[col["Metric Unit"]].strip().lower() if "Metric Unit" in col else ""
            value = _number(rec[col["Metric Value"]]) * _UNIT_SCALE.get(unit, 1.0)
            kernels[launch_id].values[rec[col["Metric Name"]]] = value
        return [kernels[i] for i in order]
    units = body[0] if body and not body[0][col.get("ID", 0)].strip().isdigit() else None
    out = []
    for rec in body[1:] if units else body:
        values = {}
        for metric in METRICS:
            if metric in col:
                unit = units[col[metric]].strip().lower() if units else ""
                values[metric] = _number(rec[col[metric]]) * _UNIT_SCALE.get(unit, 1.0)
        out.append(KernelMetrics(rec[col["Kernel Name"]], values))
    return out


def _short_name(kernel: str) -> str:
    """A kernel's name without template arguments or parameter list (``void ns::k<...>(...)`` -> ``ns::k``)."""
    name = kernel.split("<", 1)[0].split("(", 1)[0].strip()
    return name.removeprefix("void ").strip()


def summed(kernels: list[KernelMetrics]) -> dict[str, float | int | str]:
    """DRAM bytes read/written and GPU seconds summed over the kernels of one call, and ``kernel_ms``: each
    kernel's own time in launch order (``name=ms;...``), which says where a multi-kernel call spends it."""
    read = sum(k.values.get("dram__bytes_read.sum", 0.0) for k in kernels)
    write = sum(k.values.get("dram__bytes_write.sum", 0.0) for k in kernels)
    seconds = sum(k.values.get("gpu__time_duration.sum", 0.0) for k in kernels)
    per_kernel = ";".join(
        f"{_short_name(k.kernel)}={k.values.get('gpu__time_duration.sum', float('nan')) * 1e3:.4g}" for k in kernels
    )
    return {
        "kernels": len(kernels),
        "dram_read_bytes": read,
        "dram_write_bytes": write,
        "gpu_seconds": seconds,
        "kernel_ms": per_kernel,
    }
