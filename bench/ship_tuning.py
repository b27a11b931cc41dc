"""Regenerate a shipped tuning table (``attnzoo/tuning_data/*.json``) from ``attnzoo bench`` and ``tune`` logs.

    python bench/ship_tuning.py bench/results/h100_bench_fp16.log bench/results/h100_bench_bf16.log \
        --gpu "NVIDIA H100 80GB HBM3" --out attnzoo/tuning_data/nvidia-h100-80gb-hbm3.json

Each ``[tuned]`` line of a log lists a key's candidates fastest first; the first is the key's winner.  ``--gpu`` is
the name ``torch.cuda.get_device_name()`` reports on the machine that ran the logs: the table is used there only.
"""

from __future__ import annotations

import argparse
import sys

from attnzoo.kernels.tuning import write_shipped_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="attnzoo bench logs with [tuned] lines")
    parser.add_argument("--gpu", required=True, help="the GPU the logs were measured on, as CUDA names it")
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    winners = write_shipped_table(args.logs, args.gpu, args.out)
    print(f"wrote {len(winners)} winners to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
