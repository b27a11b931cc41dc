"""The README's backend table, generated from the backends' declared capabilities.

``python -m attnzoo.docs`` rewrites the table between the README's markers; a test fails when the
README's table differs from the declarations.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .backend import REQUIRED_FEATURES, get, names

BEGIN, END = "<!-- backend-table:begin -->", "<!-- backend-table:end -->"
_DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
# Short names of SPEC.md's features for the table's "not supported" column.
_FEATURE_LABELS = {"alibi": "ALiBi", "head_dim_v": "Dv != D", "nq_ne_nk": "Nq != Nk", "gqa": "GQA"}


def backend_table() -> str:
    """Markdown table: one row per registered backend, every cell read from its ``Capabilities``."""
    rows = [
        "| backend | what it is | devices | dtypes | max head dim | SPEC features not supported | deterministic "
        "| auto rank (cpu / cuda) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names():
        caps = get(name).capabilities
        dtypes = [d for d in _DTYPE_ORDER if any(str(x) == f"torch.{d}" for x in caps.dtypes)]
        devices = ", ".join(sorted(caps.devices)) + (", numpy arrays" if caps.accepts_numpy else "")
        ranks = " / ".join(str(caps.auto_rank.get(dev, "-")) for dev in ("cpu", "cuda"))
        missing = ", ".join(_FEATURE_LABELS.get(f, f) for f in sorted(REQUIRED_FEATURES - caps.features)) or "-"
        rows.append(
            f"| `{name}` | {caps.summary} | {devices} | {', '.join(dtypes)} | {caps.max_head_dim or 'any'} "
            f"| {missing} | {'yes' if caps.deterministic else 'no'} | {ranks} |"
        )
    return "\n".join(rows)


def render(readme: str) -> str:
    """``readme`` with the text between the markers replaced by the current table."""
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{backend_table()}\n{END}{tail}"


def main() -> int:
    path = Path(__file__).resolve().parent.parent / "README.md"
    path.write_text(render(path.read_text()))
    print(f"updated the backend table in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
