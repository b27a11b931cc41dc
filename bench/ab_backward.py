"""A/B of triton_2kernel's backward between source trees: each tree timed in its own processes, rounds alternating.

A kernel change is judged against its parent at fixed launch configs (the autotuner's pick moves between runs by
more than the few percent a change is worth): each tree is a copy of the ``attnzoo`` package (for example
``git archive <commit> attnzoo | tar -x -C bench/exp/trees/<name>``), imported through PYTHONPATH in a fresh
process; every kernel's config is pinned (``--dkdv`` and ``--dq`` replace the tiles timed at one head dim; every
pair of them is timed); the processes run one tree after the other and the order reverses every round, so a drift
of the GPU's state spreads over all trees. Round 1 also hashes dq/dk/dv, so equal bits across trees show as ``=``.
The table prints each point's median over the rounds, as TFLOP/s (SPEC.md's count) and as the ratio to the first
tree's first tile pair at that shape.

    python3 bench/ab_backward.py --tree main=bench/exp/trees/main --tree new=bench/exp/trees/new --rounds 3 \\
        --out $OUT/ab.csv
    python3 bench/ab_backward.py ... --tree tma=bench/exp/trees/new:ATTNZOO_X=1   # extra environment for a tree
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# (head dim, causal, N): SPEC.md's shapes, B = 16384 / N and H = 2048 / D.
SHAPES = [(128, False, 2048), (128, False, 8192), (128, True, 2048), (128, True, 16384),
          (64, False, 2048), (64, False, 16384), (64, True, 4096)]  # fmt: skip
DKDV = {128: ["64,128,8,3", "32,64,4,3"], 64: ["64,64,4,3", "32,128,4,3"]}
DQ = {128: ["128,64,8,3"], 64: ["128,64,8,3"]}
FORWARD = "128,64,8,3"


def worker(args) -> None:
    """Time every (shape, dK/dV tile, dQ tile) of this process's tree; append rows to ``args.out``."""
    import torch
    import triton
    from ptx_report import parse_config  # bench/ptx_report.py, beside this script: "BLOCK_M,BLOCK_N,warps,stages[,tma]"

    import attnzoo
    from attnzoo.backends.triton_2kernel import make_context
    from attnzoo.kernels.backward_2kernel import attention_backward_2kernel
    from attnzoo.kernels.forward import attention_forward

    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    rows = []
    variants = [(d, causal, n, dkdv, dq) for d, causal, n in SHAPES for dkdv in DKDV[d] for dq in DQ[d]]
    shard, shards = (int(x) for x in args.shard.split("/"))
    variants = variants[shard::shards]
    for d, causal, n, dkdv, dq in variants:
        n_run = 256 if args.compile_only else n  # the same specialisation, compiled on small inputs
        batch, heads = (1 if args.compile_only else 16384 // n), 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(d * 100003 + n * 2 + causal)
        q, k, v, do = (torch.randn(batch, heads, n_run, d, device="cuda", dtype=dtype, generator=gen) for _ in "qkvd")
        problem = attnzoo.get("triton_2kernel")._validate(q, k, v, causal, None, None)
        forced = {"forward": parse_config(FORWARD), "dq": parse_config(dq), "dkdv": parse_config(dkdv)}
        ctx = make_context(q, k, v, problem, None, forced_config=forced)
        o, lse = attention_forward(ctx)
        grads = attention_backward_2kernel(ctx, do, o, lse)
        torch.cuda.synchronize()
        if args.compile_only:
            continue
        digest = ""
        if args.round == 1:
            sha = hashlib.sha1()
            for g in grads:
                sha.update(g.view(torch.int16).cpu().numpy().tobytes())
            digest = sha.hexdigest()[:12]

        def backward(ctx=ctx, do=do, o=o, lse=lse):
            return attention_backward_2kernel(ctx, do, o, lse)

        start = time.perf_counter()
        while time.perf_counter() - start < 0.15:  # the first timing after compiling runs slow otherwise
            backward()
        ms = triton.testing.do_bench(backward, warmup=25, rep=100, return_mode="median")
        flops = 10 * batch * heads * n * n * d * (0.5 if causal else 1.0)
        rows.append(
            [args.name, args.round, args.dtype, d, causal, n, dkdv, dq, f"{ms:.4f}", f"{flops / ms / 1e9:.1f}", digest]
        )
        print(*rows[-1], flush=True)
        del q, k, v, do, o, lse, grads, ctx
        torch.cuda.empty_cache()
    if rows:
        with open(args.out, "a", newline="") as fh:
            csv.writer(fh).writerows(rows)


def _spawn(tree: str, extra: list[str], log: str) -> int:
    name, _, rest = tree.partition("=")
    path, _, env_text = rest.partition(":")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
    env.update(item.split("=", 1) for item in env_text.split(",") if item)
    with open(log, "w") as fh:
        cmd = [sys.executable, __file__, "--worker", "--name", name, *extra]
        return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def summarize(path: str, trees: list[str]) -> None:
    """Median TFLOP/s per point and tree, and its ratio to the first tree's first tile pair at the same shape (the
    base: the first --dkdv and --dq tiles); ``=`` where round 1's bits equal the first tree's at the same point."""
    times, digests = {}, {}
    with open(path) as fh:
        for name, _round, _dtype, d, causal, n, dkdv, dq, _ms, tflops, digest in csv.reader(fh):
            times.setdefault((d, causal, n, dkdv, dq, name), []).append(float(tflops))
            if digest:
                digests[(d, causal, n, dkdv, dq, name)] = digest
    shapes = sorted({key[:3] for key in times}, key=lambda p: (int(p[0]), p[1], int(p[2])))
    print("D causal N dkdv dq | " + " | ".join(trees))
    for shape in shapes:
        d = int(shape[0])
        base = statistics.median(times.get((*shape, DKDV[d][0], DQ[d][0], trees[0]), [float("nan")]))
        for dkdv in DKDV[d]:
            for dq in DQ[d]:
                point = (*shape, dkdv, dq)
                cells = []
                for name in trees:
                    got = times.get((*point, name))
                    if not got:
                        cells.append("-")
                        continue
                    same = "=" if digests.get((*point, name)) == digests.get((*point, trees[0])) else "!"
                    cells.append(f"{statistics.median(got):.0f} {statistics.median(got) / base:.3f}{same}")
                print(" ".join(point), "|", " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="name=path[:VAR=value,...]; the first is the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    parser.add_argument("--out", default="ab_backward.csv", help="CSV of every timing (replaced)")
    parser.add_argument(
        "--dkdv", action="append", default=[], help='dK/dV tiles of one head dim, e.g. "128=64,128,8,3 32,64,4,3"'
    )
    parser.add_argument(
        "--dq", action="append", default=[], help='dQ tiles of one head dim, e.g. "128=128,64,8,3 128,64,8,3,tma"'
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for table, items in ((DKDV, args.dkdv), (DQ, args.dq)):  # in the worker too: the options are passed on
        for item in items:
            d, _, tiles = item.partition("=")
            table[int(d)] = tiles.split()
    if args.worker:
        worker(args)
        return
    logs = os.path.dirname(os.path.abspath(args.out))
    if os.path.exists(args.out):
        os.remove(args.out)
    common = [
        "--dtype",
        args.dtype,
        "--out",
        os.path.abspath(args.out),
        *(f"--dkdv={item}" for item in args.dkdv),
        *(f"--dq={item}" for item in args.dq),
    ]
    start = time.time()
    # Compile every tree's kernels at once on all cores: each tree's (shape, tiles) list split over processes.
    shards = max(1, (os.cpu_count() or 2) // len(args.tree))
    jobs = [
        (t, [*common, "--compile-only", f"--shard={i}/{shards}"], f"{logs}/ab_compile_{t.split('=')[0]}_{i}.log")
        for t in args.tree
        for i in range(shards)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        failed = sorted({job[0] for job, rc in zip(jobs, pool.map(lambda job: _spawn(*job), jobs), strict=True) if rc})
    print(f"compiled in {time.time() - start:.0f} s; failed: {failed}", flush=True)
    order = list(args.tree)
    for r in range(1, args.rounds + 1):
        for tree in order:
            name = tree.split("=")[0]
            rc = _spawn(tree, [*common, "--round", str(r)], f"{logs}/ab_time_{name}_{r}.log")
            print(f"round {r} {name}: rc={rc} at {time.time() - start:.0f} s", flush=True)
        order.reverse()
    summarize(args.out, [t.split("=")[0] for t in args.tree])


if __name__ == "__main__":
    main()
