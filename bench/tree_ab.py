"""Alternating processes over source trees, for the A/B scripts of bench/ (``softcap_ab.py``,
``forward_config_ab.py``, ``backward_tree_ab.py``).

Each round runs ``script --child LABEL *child_args`` once per tree, with attnzoo imported from that tree
(``PYTHONPATH``), in the trees' order and reversed every other round, so that a drift of the machine between rounds
touches every tree alike.  A child prints one JSON object per line; the others are its own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def parse_trees(texts: list[str]) -> list[tuple[str, str]]:
    """``label=path`` arguments -> ``(label, path)`` pairs, in order (the first is the reference)."""
    return [tuple(text.split("=", 1)) for text in texts]


def run_rounds(script: str, trees: list[tuple[str, str]], rounds: int, child_args: list[str], out: str) -> list[dict]:
    """Every child's JSON rows, in the order they ran; each row is also appended to the JSON-lines file ``out`` as it
    comes.  A child that fails stops the run, its output shown."""
    rows = []
    with open(out, "w") as fh:
        for round_index in range(rounds):
            for label, path in trees if round_index % 2 == 0 else trees[::-1]:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
                command = [sys.executable, script, "--child", label, *child_args]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if done.returncode:
                    print(done.stdout, done.stderr, file=sys.stderr)
                    raise SystemExit(f"round {round_index} tree {label}: exit {done.returncode}")
                for line in done.stdout.splitlines():
                    if line.startswith("{"):
                        rows.append(json.loads(line))
                        fh.write(line + "\n")
            print(f"round {round_index} done", flush=True)
    return rows
