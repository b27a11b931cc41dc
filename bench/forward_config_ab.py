"""The Gluon forward pinned to given configs, in two (or more) source trees, in alternating processes; SDPA's cuDNN
timed beside it where it runs the call (no window).

Each process imports attnzoo from one tree and times, per shape, the Gluon forward kernel called directly
(``forward_gluon.attention_forward_hopper`` on a prepared call, as the GPU tests call it) at each ``--config``, as
CUDA-graph replays (``triton.testing.do_bench_cudagraph``: kernel time, no host time) and as eager calls (``do_bench``,
L2 cleared before each), medians of each. Each config's o is compared with cuDNN's (windows: the first config's), and
the run stops where they differ by more than ``MAX_DIFFERENCE``. Shapes: fp16/bf16, D = 128, H = 16, B = 16384 / N;
N = 1k and 2k with and without a causal mask, N = 16k causal, and causal sliding windows ``(w, 0)`` of 1024 keys at
N = 4k and 16k and of 4096 keys at 16k (bf16). Processes of the trees alternate, the order reversed every other
round; the table gives, per shape and config, the median replay time over the rounds in each tree and its ratio to
the first tree's, and cuDNN's time over each tree's.

    python3 bench/forward_config_ab.py --tree before=scratch/main_tree --tree after=. \\
        --config "128x128 w8 s2 gluon persistent" --config "128x128 w8 s2 gluon" --rounds 3 --out $OUT/ab.jsonl
"""

from __future__ import annotations

import json
import statistics

import tree_ab

# (dtype, N, causal, window)
SHAPES = [
    *[(dtype, n, causal, None) for dtype in ("bf16", "fp16") for n in (1024, 2048) for causal in (False, True)],
    ("bf16", 16384, True, None),
    ("bf16", 4096, True, (1024, 0)),
    ("bf16", 16384, True, (1024, 0)),
    ("bf16", 16384, True, (4096, 0)),
]
D, H, TOKENS = 128, 16, 16384
# o of unit-normal inputs: two correct 16-bit forwards differ by a few 1e-3 at most.
MAX_DIFFERENCE = 2e-2


def _shape_label(dtype: str, n: int, causal: bool, window) -> str:
    mask = f"window {window[0]}" if window else ("causal" if causal else "full")
    return f"{dtype} N={n} {mask}"


def _time_tree(label: str, configs: list[str]) -> None:
    """In this process (attnzoo from the tree on sys.path): one JSON line per shape."""
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnzoo.kernels import tuning
    from attnzoo.kernels.forward_gluon import attention_forward_hopper
    from attnzoo.kernels.launch import prepare
    from attnzoo.validation import validate_forward

    for dtype_name, n, causal, window in SHAPES:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(n + causal)
        q, k, v = (torch.randn(TOKENS // n, H, n, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
        call = prepare(q, k, v, validate_forward(q, k, v, causal, window=window))
        row = dict(tree=label, shape=_shape_label(dtype_name, n, causal, window))
        reference = None  # o of cuDNN, or (windows) of the first config
        if window is None:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: B023, E731
                reference = run()
                row["cudnn"] = triton.testing.do_bench_cudagraph(run, return_mode="median")
        for text in configs:
            cfg = tuning.KernelConfig.parse(text)
            o = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)

            def run(cfg=cfg, o=o, lse=lse, call=call, causal=causal):
                attention_forward_hopper(
                    call.q, call.k, call.v, o, lse, call.scale, causal, call.modifiers, cfg.block_m, cfg.block_n,
                    cfg.num_warps, cfg.num_stages, persistent=cfg.persistent,
                )  # fmt: skip

            run()
            torch.cuda.synchronize()
            if not torch.isfinite(o).all():
                raise SystemExit(f"{label} {text} {row['shape']}: o holds non-finite values")
            if reference is None:
                reference = o.clone()
            else:  # a wrong but finite o (a slot overwritten too early) stops the run
                difference = (o.float() - reference.float()).abs().max().item()
                row[f"{text} max|o - reference|"] = difference
                if difference > MAX_DIFFERENCE:
                    raise SystemExit(f"{label} {text} {row['shape']}: max |o - reference| = {difference:.3g}")
            row[text] = triton.testing.do_bench_cudagraph(run, return_mode="median")
            row[f"{text} eager"] = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        print(json.dumps(row), flush=True)


def _table(rows: list[dict], trees: list[str], configs: list[str]) -> list[str]:
    by = tree_ab.rows_by(rows, "shape", "tree")
    lines = []
    for dtype, n, causal, window in SHAPES:
        shape = _shape_label(dtype, n, causal, window)
        for text in configs:
            times = {t: statistics.median(r[text] for r in by[(shape, t)]) for t in trees}
            cells = []
            for t in trees:
                cudnn = [r["cudnn"] / r[text] for r in by[(shape, t)] if "cudnn" in r]
                versus = f", cuDNN/it {statistics.median(cudnn):.3f}" if cudnn else ""
                cells.append(f"{t} {times[t] * 1e3:7.1f} us ({times[trees[0]] / times[t]:.3f}x{versus})")
            lines.append(f"{shape:24} {text:32} " + "  ".join(cells))
    return lines


def main() -> None:
    cli = tree_ab.parser(__doc__)
    cli.add_argument("--config", action="append", required=True, help="a Gluon forward config ('128x128 w8 s2')")
    args = cli.parse_args()
    config_args = [arg for text in args.config for arg in ("--config", text)]
    tree_ab.main(
        cli, args, __file__, config_args, lambda label: _time_tree(label, args.config),
        lambda rows, trees: _table(rows, trees, args.config),
    )  # fmt: skip


if __name__ == "__main__":
    main()
