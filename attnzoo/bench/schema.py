"""The benchmark CSV: its columns, and the operation counts that turn times into TFLOP/s.

FLOPs are counted as in SPEC.md (and FlashAttention's papers): the forward is two ``N x N x D`` matrix
products per head, ``4 * B * H * N^2 * D``, halved when causal (only the lower triangle is useful work);
the backward is counted as 2.5x the forward (five products instead of two).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

COLUMNS = [
    "gpu_name",
    "gpu_sm",
    "driver",
    "torch_version",
    "triton_version",
    "dtype",
    "mode",
    "impl",
    "B",
    "H",
    "Hkv",
    "N",
    "D",
    "causal",
    "seqlen_k",
    "fwd_ms",
    "bwd_ms",
    "total_ms",
    "tflops_fwd",
    "tflops_bwd",
    "tokens_per_s",
    "peak_mem_mb",
    "speedup_vs_sdpa_flash",
    "speedup_vs_sdpa_cudnn",
    "skip_ratio",
    "status",
]

# status values: "ok", "oom", "skipped: <reason>", "error: <message>"
STATUS_OK = "ok"
STATUS_OOM = "oom"

BACKWARD_FLOP_FACTOR = 2.5


def forward_flops(B: int, H: int, N: int, D: int, causal: bool, seqlen_k: int | None = None) -> float:
    """Useful floating-point operations of one attention forward (``Nq == Nk == N``): 4·D per visible
    (query, key) pair, SPEC.md's 4·B·H·N²·D (half of it causal) when every key is valid.

    ``seqlen_k``: keys visible per batch (padding masks the rest): N·L pairs, or L²/2 + (N - L)·L causal.
    """
    L = N if seqlen_k is None else min(seqlen_k, N)
    pairs = (L * L / 2 + (N - L) * L) if causal else N * L
    return 4.0 * B * H * pairs * D


def backward_flops(B: int, H: int, N: int, D: int, causal: bool, seqlen_k: int | None = None) -> float:
    """Useful floating-point operations of one attention backward: 2.5x the forward."""
    return BACKWARD_FLOP_FACTOR * forward_flops(B, H, N, D, causal, seqlen_k)


def parse_lengths(text: str) -> list[int]:
    """ "1024,2k,16k" -> [1024, 2048, 16384] ("k" means 1024: sequence lengths are powers of two)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def status_kind(status: str) -> str:
    """The kind of a status cell: ``ok``, ``oom``, ``skipped`` or ``error``."""
    return status.split(":", 1)[0].strip()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: str | Path, rows: Iterable[dict], append: bool = False) -> None:
    """Write rows (dicts keyed by :data:`COLUMNS`; missing keys are empty cells) to ``path``.

    ``append`` adds the rows to an existing file without a header.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if not append:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in COLUMNS})


_INT_COLUMNS = {"B", "H", "Hkv", "N", "D", "seqlen_k"}
_FLOAT_COLUMNS = {
    "fwd_ms",
    "bwd_ms",
    "total_ms",
    "tflops_fwd",
    "tflops_bwd",
    "tokens_per_s",
    "peak_mem_mb",
    "speedup_vs_sdpa_flash",
    "speedup_vs_sdpa_cudnn",
    "skip_ratio",
}


def read_csv(path: str | Path) -> list[dict]:
    """Read a bench CSV back: numbers as int/float, empty cells as None, ``causal`` as bool."""
    rows = []
    with Path(path).open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict = {}
            for key, text in raw.items():
                if key in _INT_COLUMNS:
                    row[key] = int(text) if text else None
                elif key in _FLOAT_COLUMNS:
                    row[key] = float(text) if text else None
                elif key == "causal":
                    row[key] = text == "yes"
                else:
                    row[key] = text
            rows.append(row)
    return rows
