"""``python -m attnzoo.bench.coldstart``: what a user pays on first use, measured in fresh processes.

Each scenario runs a new Python process that imports attnzoo and times, with the GPU synchronised, its first
forward + backward through ``attnzoo.attention`` (fp16, D = 128, N = 4096, causal by default), then in the same
process a call at a new power-of-two N bucket and one at a new head dim.  The scenarios differ by what is on disk
before the process starts:

- ``empty``: an empty Triton kernel cache and an empty attnzoo tuning cache (a first install);
- ``warm``: the caches the ``empty`` run left (a second process, e.g. the next training run).

Triton's cache goes to ``TRITON_CACHE_DIR``, attnzoo's to ``ATTNZOO_CACHE_DIR`` and Python's bytecode to
``PYTHONPYCACHEPREFIX``, all in a temporary directory, so that the user's caches are never read nor written.  The
bytecode cache matters on the device image, whose torch has no usable ``.pyc`` files: there every process compiled
about 850 modules to bytecode again (5.2 s of a 7.5 s ``import attnzoo``, most of it ``torch._dynamo`` and sympy,
by cProfile), which an ordinary install does once.  ``--pythonpath`` runs another copy of the package (to measure a
previous version the same way).  One CSV row per (label, scenario, measurement), and a table on stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The child: everything it measures is printed as one JSON line.
_CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
import attnzoo
imported = time.perf_counter() - start
spec = json.loads(sys.argv[1])
dtype = getattr(torch, spec["dtype"])

def first_step(n, d):
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    shape = (spec["batch"], spec["heads"], n, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    torch.cuda.synchronize()
    t = time.perf_counter()
    attnzoo.attention(q, k, v, causal=spec["causal"], backend=spec["backend"]).backward(do)
    torch.cuda.synchronize()
    return time.perf_counter() - t

torch.zeros(1, device="cuda")  # the CUDA context, so that it is not counted in the first call
result = {"import_s": imported, "first_call_s": first_step(spec["N"], spec["D"])}
result["second_call_s"] = first_step(spec["N"], spec["D"])
result["new_N_bucket_s"] = first_step(spec["new_N"], spec["D"])
result["new_head_dim_s"] = first_step(spec["N"], spec["new_D"])
print("RESULT " + json.dumps(result))
"""

MEASUREMENTS = ("import_s", "first_call_s", "second_call_s", "new_N_bucket_s", "new_head_dim_s")


def run_child(spec: dict, env: dict, pythonpath: str | None) -> dict:
    """One fresh process; returns its measurements (seconds) plus its total wall time."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    import time

    start = time.perf_counter()
    # From a neutral directory: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        env=env, capture_output=True, text=True, check=False, cwd=str(Path(env["TRITON_CACHE_DIR"]).parent),
    )  # fmt: skip
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "process_wall_s": wall}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m attnzoo.bench.coldstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="current", help="name of this measurement in the CSV (e.g. before, after)")
    p.add_argument("--pythonpath", default=None, help="import attnzoo from this directory instead")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--N", type=int, default=4096, help="sequence length of the first call")
    p.add_argument("--D", type=int, default=128, help="head dim of the first call")
    p.add_argument("--new-N", type=int, default=2048, help="the call at a new N bucket")
    p.add_argument("--new-D", type=int, default=64, help="the call at a new head dim")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE set in the child processes (repeatable)")
    p.add_argument("--out", default=None, help="CSV to append rows to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = dict(
        dtype=args.dtype, N=args.N, D=args.D, new_N=args.new_N, new_D=args.new_D, batch=args.batch,
        heads=args.heads, causal=args.causal, backend=args.backend,
    )  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnzoo-coldstart-") as tmp:
        env = dict(
            os.environ,
            TRITON_CACHE_DIR=str(Path(tmp, "triton")),
            ATTNZOO_CACHE_DIR=str(Path(tmp, "attnzoo")),
            PYTHONPYCACHEPREFIX=str(Path(tmp, "pycache")),
        )
        for pair in args.env:
            key, _, value = pair.partition("=")
            env[key] = value
        for scenario in ("empty", "warm"):
            measured = run_child(spec, env, args.pythonpath)
            for name, seconds in measured.items():
                rows.append(dict(label=args.label, scenario=scenario, measurement=name, seconds=round(seconds, 3)))
    for key, value in spec.items():
        for row in rows:
            row[key] = value
    if args.out:
        path = Path(args.out)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
    print(f"{'label':<10} {'scenario':<8} " + " ".join(f"{m:>15}" for m in (*MEASUREMENTS, "process_wall_s")))
    for scenario in ("empty", "warm"):
        values = {r["measurement"]: r["seconds"] for r in rows if r["scenario"] == scenario}
        cells = " ".join(f"{values[m]:>15.2f}" for m in (*MEASUREMENTS, "process_wall_s"))
        print(f"{args.label:<10} {scenario:<8} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
