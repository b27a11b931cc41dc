"""A/B of forward tiles at fixed configs: Gluon Hopper tiles against pinned Triton tiles, SDPA flash and cuDNN.

Each shape of SPEC.md's grid (B = 16384/N, H = 2048/D) is timed as the grid times it (``median_ms``: 3 warm-up calls
and 100 ms, median of 10 after an L2 flush), every entry in alternating rounds; the line gives the medians in
TFLOP/s and the best Gluon tile over the best Triton tile and over cuDNN.  The tiles are pinned, so the autotuner
plays no part: this is how the Gluon candidates in ``tuning.py`` were chosen (docs/NOTES-kernels.md).

    PYTHONPATH=$PWD python3 bench/ab_forward.py --dtype fp16,bf16 --d 64,128 --N 2048,8192 --rounds 2
    PYTHONPATH=$PWD python3 bench/ab_forward.py --d 128 --gluon "64,64,4,2;128,128,8,2" --triton "128,128,8,3,tma"
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from attnzoo.bench import timing
from attnzoo.kernels.forward import attention_forward
from attnzoo.kernels.forward_gluon import attention_forward_hopper
from attnzoo.kernels.launch import LaunchContext
from attnzoo.kernels.tuning import KernelConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GLUON = "128,128,8,2;128,128,8,3;128,64,8,2;128,64,8,3;64,128,4,2;64,64,4,2"
TRITON = "128,128,8,3,tma;128,64,8,3,tma;64,64,4,3"


def _configs(text: str) -> list[KernelConfig]:
    """``BM,BN,warps,stages[,tma];...`` -> configs (each parsed as ``bench/ptx_report.py`` parses one)."""
    from ptx_report import parse_config  # beside this script

    return [parse_config(item) for item in text.split(";") if item]


def _sdpa(q, k, v, causal: bool, backend) -> torch.Tensor:
    with torch.nn.attention.sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def time_shape(dtype: torch.dtype, d: int, n: int, causal: bool, gluon, triton_tiles, rounds: int) -> dict:
    """Median TFLOP/s of every entry at one shape."""
    device = torch.device("cuda")
    b, h = 16384 // n, 2048 // d
    gen = torch.Generator(device=device).manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    scale = d**-0.5
    o, lse = torch.empty_like(q), torch.empty(b, h, n, device=device, dtype=torch.float32)
    entries = {}
    for cfg in gluon:
        entries[f"gluon {cfg}"] = lambda c=cfg: attention_forward_hopper(
            q, k, v, o, lse, scale, causal, c.block_m, c.block_n, c.num_warps, c.num_stages
        )
    for cfg in triton_tiles:
        entries[f"triton {cfg}"] = lambda c=cfg: attention_forward(
            LaunchContext(q, k, v, scale, causal, None, forced_config={"forward": c})
        )
    entries["flash"] = lambda: _sdpa(q, k, v, causal, torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    entries["cudnn"] = lambda: _sdpa(q, k, v, causal, torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    for fn in entries.values():
        fn()  # compile outside the timing
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    tflops = {name: [] for name in entries}
    for r in range(rounds):
        for name in list(entries) if r % 2 == 0 else list(entries)[::-1]:
            tflops[name].append(flops / timing.median_ms(entries[name], device, 3, 10, 100.0) / 1e9)
    return {name: statistics.median(values) for name, values in tflops.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp16,bf16")
    p.add_argument("--d", default="64,128")
    p.add_argument("--N", default="2048,8192")
    p.add_argument("--causal", default="no,yes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gluon", default=GLUON, help="Gluon tiles BM,BN,warps,stages;...")
    p.add_argument("--triton", default=TRITON, help="Triton tiles BM,BN,warps,stages[,tma];...")
    args = p.parse_args()
    gluon, triton_tiles = _configs(args.gluon), _configs(args.triton)
    for dt in args.dtype.split(","):
        for d in map(int, args.d.split(",")):
            for causal in (c == "yes" for c in args.causal.split(",")):
                for n in map(int, args.N.split(",")):
                    med = time_shape(DTYPES[dt], d, n, causal, gluon, triton_tiles, args.rounds)
                    best_gluon = max((v, k) for k, v in med.items() if k.startswith("gluon"))
                    best_triton = max(v for k, v in med.items() if k.startswith("triton"))
                    print(
                        f"{dt} D={d} causal={causal} N={n}: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items())
                        + f" | best {best_gluon[1]} = {best_gluon[0] / best_triton:.3f}x best triton, "
                        f"{best_gluon[0] / med['cudnn']:.3f}x cudnn",
                        flush=True,
                    )  # fmt: skip
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
