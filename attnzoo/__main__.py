"""``python -m attnzoo <command>``: compare, bench, plot, io, tune."""

from __future__ import annotations

import importlib
import sys

from .cli import unknown_name

COMMANDS = {
    "compare": ("attnzoo.compare", "run every backend on one case and print errors vs the float64 oracle"),
    "bench": (
        "attnzoo.bench.run",
        "time backends and SDPA over a grid of shapes (a CSV); `bench ab`: A/B in rounds",
    ),
    "plot": ("attnzoo.bench.plot", "draw the benchmark figures from a bench CSV"),
    "io": ("attnzoo.bench.io", "HBM traffic: IO-complexity theory and Nsight Compute measurements"),
    "tune": ("attnzoo.tune", "time the Triton kernels' configs for some shapes and store the winners on disk"),
}


def _usage() -> str:
    lines = ["usage: python -m attnzoo <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "python -m attnzoo <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:  # a usage error, as argparse treats a missing required argument
        print(f"{_usage()}\n\nerror: no command given", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{_usage()}\n\nerror: {unknown_name('command', command, COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
