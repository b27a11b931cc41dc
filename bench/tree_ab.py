"""Alternating processes over source trees, for the A/B scripts of bench/ (``softcap_ab.py``,
``forward_config_ab.py``, ``backward_tree_ab.py``).

Each round runs ``script --child LABEL *child_args`` once per tree, with attnzoo imported from that tree
(``PYTHONPATH``), in the trees' order and reversed every other round, so that a drift of the machine between rounds
touches every tree alike.  A child prints one JSON object per line; the others are its own output.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from collections.abc import Callable


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


def rows_by(rows: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    """The children's rows grouped by the values of ``fields`` (the tree's label last, say), each group in run
    order; a key no row has gives an empty list."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[tuple(row[field] for field in fields)].append(row)
    return groups


def parser(doc: str) -> argparse.ArgumentParser:
    """A command line with the options every tree A/B takes: ``--tree label=path`` (two or more, the first the
    reference), ``--rounds``, ``--out`` (the JSON lines), and the children's hidden ``--child LABEL``; a script adds
    its own."""
    cli = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    cli.add_argument("--tree", action="append", default=[], help="label=path (two or more; the first is the reference)")
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--out", help="JSON lines of every process's timings")
    cli.add_argument("--child", metavar="LABEL", help=argparse.SUPPRESS)
    return cli


def main(
    cli: argparse.ArgumentParser,
    args: argparse.Namespace,
    script: str,
    child_args: list[str],
    time_child: Callable[[str], None],
    table: Callable[[list[dict], list[str]], list[str]],
) -> None:
    """``args``, parsed by ``cli``: as a child (``--child LABEL``) run ``time_child(LABEL)`` in this process; else run
    the rounds of ``script`` over the trees, its children given ``child_args``, and print ``table(rows, labels)``."""
    if args.child:
        time_child(args.child)
        return
    if len(args.tree) < 2 or not args.out:
        cli.error("give two or more --tree label=path and --out")
    trees = parse_trees(args.tree)
    rows = run_rounds(script, trees, args.rounds, child_args, args.out)
    print("\n".join(table(rows, [label for label, _ in trees])))
