"""The soft cap's cost over the plain call, in two (or more) source trees, in alternating processes.

Each process imports attnzoo from one tree and times, per shape, the forward (``--pass fwd``) or the backward
(``--pass bwd``: ``torch.autograd.grad`` on a retained graph) of the plain call and of the same call with
``softcap=30`` (``triton_2kernel``'s stored or heuristic configs; fp16/bf16, D = 128, B = 16384 / N, H = 16, causal
and not), each a ``triton.testing.do_bench`` median after warm-up.  Processes of the trees alternate, the order
reversed every other round; the table gives, per shape and tree, the median over the rounds of the capped time, of
the plain time and of their ratio in the same process (the cost), and the capped call's speed against the first
tree.

    python3 bench/softcap_ab.py --tree before=scratch/main_tree --tree after=. --rounds 3 --out $OUT/ab.jsonl
"""

from __future__ import annotations

import json
import statistics

import tree_ab

CAP = 30.0
SHAPES = [(dtype, n, causal) for dtype in ("bf16", "fp16") for n in (4096, 16384) for causal in (True, False)]


def _time_tree(label: str, which: str) -> None:
    """In this process (attnzoo from the tree on sys.path): one JSON line per shape."""
    import torch
    import triton

    import attnzoo

    backend = attnzoo.get("triton_2kernel")
    for dtype_name, n, causal in SHAPES:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(n + causal)
        q, k, v, do = (torch.randn(16384 // n, 16, n, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        row = dict(tree=label, dtype=dtype_name, N=n, causal=causal, **{"pass": which})
        for name, cap in (("plain", 0.0), ("softcap", CAP)):
            kwargs = dict(causal=causal, softcap=cap, backend=backend)
            if which == "fwd":
                run = lambda: attnzoo.attention(q, k, v, **kwargs)  # noqa: B023, E731
            else:
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                out = attnzoo.attention(*leaves, **kwargs)
                run = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: B023, E731
            row[name] = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        row["cost"] = row["softcap"] / row["plain"]
        print(json.dumps(row), flush=True)


def _table(rows: list[dict], trees: list[str]) -> list[str]:
    by = tree_ab.rows_by(rows, "dtype", "N", "causal", "tree")
    lines = []
    for dtype, n, causal in SHAPES:
        first = statistics.median(r["softcap"] for r in by[(dtype, n, causal, trees[0])])
        cells = []
        for tree in trees:
            got = by[(dtype, n, causal, tree)]
            capped = statistics.median(r["softcap"] for r in got)
            cells.append(
                f"{tree}: capped {capped:.3f} ms, plain {statistics.median(r['plain'] for r in got):.3f} ms, "
                f"cost {statistics.median(r['cost'] for r in got):.3f}, speed x{first / capped:.3f}"
            )
        lines.append(f"{dtype} N={n} {'causal' if causal else 'full'}: " + " | ".join(cells))
    return lines


def main() -> None:
    cli = tree_ab.parser(__doc__)
    cli.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    args = cli.parse_args()
    tree_ab.main(cli, args, __file__, ["--pass", args.which], lambda label: _time_tree(label, args.which), _table)


if __name__ == "__main__":
    main()
