"""The backward above D = 128 (D = 192 with Dv = 128, DeepSeek's MLA shape, and D = Dv = 256) on the head-dim-split
Gluon kernels (``backward_gluon_wide.py``) against the Triton tiles that the heuristic picks without them and
SDPA's cuDNN and FlashAttention kernels, timed in alternating rounds in one process (``triton.testing.do_bench``
medians, gradients reset between calls).

    PYTHONPATH=$PWD python3 bench/wide_backward_ab.py --out bench/results/h100_d192_wide_bwd.csv
    PYTHONPATH=$PWD python3 bench/wide_backward_ab.py --window 1024 --out bench/results/h100_wide_bwd_window.csv

``--window W``: causal calls with ``window=(W, 0)`` (a sliding window, as Gemma's local layers at D = 256 have) at
the shapes with N >= 8k, against the Triton tiles (SDPA has no window).  Only the backward's kernels are pinned: both
attnzoo rows of a shape time the same forward, so their forward columns differ by noise alone.

Useful FLOPs as in ``attnzoo.bench.modifiers``: the forward ``2 * pairs * (D + Dv)``, the backward 2.5x that (pairs:
the visible (query, key) pairs; half of N^2 with a causal mask).  An impl that cannot run a shape (SDPA's
FlashAttention with Dv != D) is left out of it, with its error printed.
"""

from __future__ import annotations

import argparse
import csv
import statistics

import torch
import triton

import attnzoo
from attnzoo.kernels.tuning import KernelConfig

# (dtype, D, Dv, N) with both masks; B = 16384 / N, H = 16.
SHAPES = [
    *((torch.bfloat16, 192, 128, n) for n in (2048, 8192, 16384)),
    (torch.float16, 192, 128, 8192),
    (torch.bfloat16, 256, 256, 8192),
]


def _triton_2kernel(dkdv: str, dq: str) -> attnzoo.Backend:
    return attnzoo.get("triton_2kernel", configs={"dkdv": KernelConfig.parse(dkdv), "dq": KernelConfig.parse(dq)})


def _runner(impl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple | None = None):
    """A forward call of ``impl`` (an attnzoo Backend, or "cudnn" / "flash" for SDPA's kernels) on these inputs."""
    if isinstance(impl, attnzoo.Backend):
        return lambda: attnzoo.attention(q, k, v, causal=causal, window=window, backend=impl)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[impl]

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _forward_and_backward_ms(run, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """do_bench medians of the forward and of the backward of one saved graph (gradients reset between calls)."""
    out = run()
    grad = torch.randn_like(out)

    def backward():
        out.backward(grad, retain_graph=True)

    fwd = triton.testing.do_bench(run, warmup=25, rep=100)
    return fwd, triton.testing.do_bench(backward, warmup=25, rep=100, grad_to_none=inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/h100_d192_wide_bwd.csv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=None, help="causal calls with window=(W, 0), N >= 8k")
    args = parser.parse_args()
    window = None if args.window is None else (args.window, 0)
    rows = []
    for index, (dtype, D, Dv, N) in enumerate(SHAPES):
        if window is not None and N < 8192:
            continue
        for causal in (False, True) if window is None else (True,):
            B, H = max(1, 16384 // N), 16
            gen = torch.Generator(device="cuda").manual_seed(index * 2 + causal)
            q, k = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
            v = torch.randn(B, H, N, Dv, device="cuda", dtype=dtype, generator=gen)
            inputs = [x.requires_grad_() for x in (q, k, v)]
            impls = {"gluon_wide": _triton_2kernel("64x64 w4 s2 gluon", "64x64 w4 s2 gluon")}
            # The untimed picks outside the Gluon scope (tests/test_triton.py); at D = 256 they ran the backward at
            # 0.42-0.48x cuDNN (docs/design.md), timed only beside a window.
            if D == 192:
                impls["triton_tiles"] = _triton_2kernel("32x128 w8 s3", "64x64 w4 s3 tma")
            elif window is not None:
                impls["triton_tiles"] = _triton_2kernel("64x32 w8 s2", "64x32 w4 s2")
            if window is None:
                impls.update(sdpa_cudnn="cudnn", sdpa_flash="flash")
            runs = {name: _runner(impl, *inputs, causal, window) for name, impl in impls.items()}
            times = {name: [] for name in runs}
            for r in range(args.rounds):
                for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    if name not in times:
                        continue
                    try:
                        times[name].append(_forward_and_backward_ms(runs[name], inputs))
                    except RuntimeError as error:  # no kernel for this shape
                        print(f"{name} D={D} Dv={Dv}: {str(error).splitlines()[0]}")
                        times.pop(name)
            if window is None:
                pairs = N * N * (0.5 if causal else 1.0)
            else:  # row i sees keys i - W .. i
                pairs = N * (window[0] + 1) - window[0] * (window[0] + 1) / 2
            flops = 2 * B * H * pairs * (D + Dv)
            cudnn_ms = statistics.median(t[1] for t in times["sdpa_cudnn"]) if "sdpa_cudnn" in times else None
            for name, timings in times.items():
                fwd, bwd = (statistics.median(t[i] for t in timings) for i in (0, 1))
                rows.append(dict(
                    dtype=str(dtype)[6:], D=D, Dv=Dv, N=N, causal=causal, window=args.window or "", impl=name,
                    fwd_ms=fwd, bwd_ms=bwd,
                    fwd_tflops=flops / fwd / 1e9, bwd_tflops=2.5 * flops / bwd / 1e9,
                    bwd_rounds=" ".join(f"{t[1]:.3f}" for t in timings),
                ))  # fmt: skip
                ratio = f"{cudnn_ms / bwd:.2f}x cuDNN" if cudnn_ms else "no cuDNN"
                print(
                    f"{rows[-1]['dtype']} D={D} Dv={Dv} N={N} causal={causal} window={window} {name}: forward "
                    f"{fwd:.3f} ms, backward {bwd:.3f} ms, "
                    f"{rows[-1]['bwd_tflops']:.0f} TFLOP/s, {ratio}", flush=True
                )  # fmt: skip
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
