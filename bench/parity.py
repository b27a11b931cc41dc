"""triton_2kernel against FlexAttention and SDPA flash, each shape timed in several alternating rounds.

One grid row is one timing, and timings of one kernel minutes apart differ by 1-5% (bench/README.md), so a ratio
within a few percent of 1.0 in the grid does not say which side is faster. This times the shapes of SPEC.md's grid
(B = 16384/N, H = 2048/D) exactly as the grid does (the bench's impls and ``median_ms``: 3 warm-up calls and 100 ms,
median of 10 after an L2 flush), forward and backward, with the three impls alternating in ``--rounds`` rounds, and
prints each ratio of medians with the range of the per-round ratios. About 20 s per shape on the H100.

    python3 bench/parity.py --dtype fp16,bf16 --d 128 --N 1024,2048,8192,16384 --rounds 5 --out $OUT/parity.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics

import torch

from attnzoo.bench import impls as impl_registry
from attnzoo.bench import timing
from attnzoo.kernels import tuning

IMPLS = ["triton_2kernel", "flex_attention", "sdpa_flash"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp16,bf16")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--N", default="1024,2048,8192,16384")
    p.add_argument("--causal", default="no,yes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="CSV of every ratio")
    p.add_argument("--impls", default=",".join(IMPLS), help="triton_2kernel first, then the references")
    args = p.parse_args()
    impls = args.impls.split(",")
    device = torch.device("cuda")
    rows = []
    for dt in args.dtype.split(","):
        for causal in (c == "yes" for c in args.causal.split(",")):
            for n in (int(x) for x in args.N.split(",")):
                b, h, d = 16384 // n, 2048 // args.d, args.d
                gen = torch.Generator(device=device).manual_seed(n + causal)
                q, k, v, do = (
                    torch.randn(b, h, n, d, device=device, dtype=DTYPES[dt], generator=gen) for _ in range(4)
                )
                inputs = impl_registry.Inputs(q, k, v, do, causal, None)
                prepared = {}
                for name in impls:
                    impl = impl_registry.get_impl(name).prepare(inputs, True)
                    impl.step()  # compilation and autotuning, never timed
                    prepared[name] = (impl.forward, impl.make_backward())
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                tflops = {(name, part): [] for name in impls for part in ("fwd", "bwd")}
                for r in range(args.rounds):
                    for name in impls if r % 2 == 0 else impls[::-1]:
                        forward, backward = prepared[name]
                        fwd_ms = timing.median_ms(forward, device, 3, 10, 100.0)
                        bwd_ms = timing.median_ms(backward, device, 3, 10, 100.0)
                        tflops[(name, "fwd")].append(flops / fwd_ms / 1e9)
                        tflops[(name, "bwd")].append(2.5 * flops / bwd_ms / 1e9)
                line = f"{dt} D={d} causal={causal} N={n}:"
                for part in ("fwd", "bwd"):
                    ours = tflops[(impls[0], part)]
                    for ref in impls[1:]:
                        per_round = [a / b_ for a, b_ in zip(ours, tflops[(ref, part)], strict=True)]
                        ratio = statistics.median(ours) / statistics.median(tflops[(ref, part)])
                        rows.append([dt, d, causal, n, part, ref, f"{statistics.median(ours):.1f}",
                                     f"{statistics.median(tflops[(ref, part)]):.1f}", f"{ratio:.3f}",
                                     f"{min(per_round):.3f}", f"{max(per_round):.3f}"])  # fmt: skip
                        line += f" {part}/{ref} {ratio:.3f} [{min(per_round):.3f}-{max(per_round):.3f}]"
                print(line, flush=True)
                del prepared, inputs, q, k, v, do
                torch.cuda.empty_cache()
    for line in tuning.tuned_report().values():  # what the tuner picked for each kernel and shape, with its timings
        print("[tuned]", line, flush=True)
    if args.out:
        with open(args.out, "w", newline="") as fh:
            header = ["dtype", "D", "causal", "N", "part", "ref", "triton_2kernel", "ref_tflops", "ratio_of_medians",
                      "min_round_ratio", "max_round_ratio"]  # fmt: skip
            csv.writer(fh).writerows([header, *rows])


if __name__ == "__main__":
    main()
