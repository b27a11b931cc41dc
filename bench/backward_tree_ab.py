"""The backward of a backend (``triton_atomic`` by default: the five-product kernel on Hopper) in two or more source
trees, in alternating processes, on each tree's shipped tuning table; SDPA's cuDNN backward timed beside it in the
same process.

Each process imports attnzoo from one tree and times, per shape, ``out.backward`` of the backend's call and of cuDNN's
(``triton.testing.do_bench`` medians, L2 cleared before each call, as the grids time it), and compares the backend's
gradients with cuDNN's: the run stops where they differ by more than ``MAX_DIFFERENCE``.  Shapes: fp16/bf16, D = 64
and 128, N = 1k, 4k and 16k (B = 16384 / N, H = 2048 / D), with and without a causal mask.  The trees' processes
alternate, the order reversed every other round; the table gives, per shape, the median backward time over the
rounds in each tree, its speed over the first tree's, and cuDNN's time over it.

    python3 bench/backward_tree_ab.py --tree before=scratch/head_tree --tree after=. --rounds 3 --out $OUT/ab.jsonl
"""

from __future__ import annotations

import json
import statistics

import tree_ab

# (dtype, D, N, causal)
SHAPES = [
    (dtype, d, n, causal)
    for d in (128, 64)
    for dtype in ("bf16", "fp16")
    for n in (1024, 4096, 16384)
    for causal in (False, True)
]
TOKENS, HIDDEN = 16384, 2048
# dQ, dK, dV of unit-normal inputs against cuDNN's: a few 1e-3 for two correct 16-bit backwards.
MAX_DIFFERENCE = 5e-2


def _shape_label(dtype: str, d: int, n: int, causal: bool) -> str:
    return f"{dtype} D={d} N={n} {'causal' if causal else 'full'}"


def _time_tree(label: str, backend_name: str) -> None:
    """In this process (attnzoo from the tree on sys.path): one JSON line per shape."""
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnzoo

    backend = attnzoo.get(backend_name)
    for dtype_name, d, n, causal in SHAPES:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
        shape = (TOKENS // n, HIDDEN // d, n, d)
        q, k, v, grad = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        row = dict(tree=label, shape=_shape_label(dtype_name, d, n, causal))
        gradients = {}
        for name in ("backend", "cudnn"):
            if name == "backend":
                out = attnzoo.attention(q, k, v, causal=causal, backend=backend)
            else:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.backward(grad, retain_graph=True)
            gradients[name] = [x.grad.clone() for x in (q, k, v)]
            if not all(torch.isfinite(g).all() for g in gradients[name]):
                raise SystemExit(f"{label} {name} {row['shape']}: non-finite gradients")
            step = lambda out=out, grad=grad: out.backward(grad, retain_graph=True)  # noqa: E731
            row[name] = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
            q.grad = k.grad = v.grad = None
        for name, ours, theirs in zip(("dq", "dk", "dv"), gradients["backend"], gradients["cudnn"], strict=True):
            row[f"max|{name} - cudnn|"] = difference = (ours.float() - theirs.float()).abs().max().item()
            if difference > MAX_DIFFERENCE:
                raise SystemExit(f"{label} {row['shape']}: max |{name} - cuDNN's| = {difference:.3g}")
        print(json.dumps(row), flush=True)


def _table(rows: list[dict], trees: list[str]) -> list[str]:
    by = tree_ab.rows_by(rows, "shape", "tree")
    lines = []
    for dtype, d, n, causal in SHAPES:
        shape = _shape_label(dtype, d, n, causal)
        times = {t: statistics.median(r["backend"] for r in by[(shape, t)]) for t in trees}
        cells = []
        for t in trees:
            cudnn = statistics.median(r["cudnn"] / r["backend"] for r in by[(shape, t)])
            cells.append(f"{t} {times[t]:7.3f} ms ({times[trees[0]] / times[t]:.3f}x, cuDNN/it {cudnn:.3f})")
        lines.append(f"{shape:26} " + "  ".join(cells))
    return lines


def main() -> None:
    cli = tree_ab.parser(__doc__)
    cli.add_argument("--backend", default="triton_atomic")
    args = cli.parse_args()
    tree_ab.main(
        cli, args, __file__, ["--backend", args.backend], lambda label: _time_tree(label, args.backend), _table
    )


if __name__ == "__main__":
    main()
