"""One round of a host-time A/B of two source trees, in this process (bench/results/h100_compiled_launch_host_ab.log).

Host time: median microseconds of one call with the GPU synchronised before each (B = H = 1, N = 128, D = 64, fp16,
causal): ``triton_2kernel``'s forward and backward, ``triton_atomic``'s backward, a training step through
``attnzoo.attention`` and SDPA's cuDNN forward.  Then the N = 1k forwards (B = 16, H = 2048 / D) timed as the grids
time them (``bench.timing.median_ms``: a 256 MB write before each call), as cuDNN's time over ours.  Rounds of fresh
processes, the trees alternating:

    for r in 1 2 3 4; do
        PYTHONPATH=/path/to/old python3 bench/host_time_ab.py old
        PYTHONPATH=$PWD python3 bench/host_time_ab.py new
    done
"""

import sys

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench.timing import host_us, median_ms

CUDNN = torch.nn.attention.SDPBackend.CUDNN_ATTENTION
GRID_FORWARDS = [  # (dtype, D, causal): the N = 1k forwards of the grids
    (torch.float16, 128, False),
    (torch.bfloat16, 128, True),
    (torch.float16, 64, True),
    (torch.bfloat16, 64, True),
    (torch.bfloat16, 128, False),
    (torch.float16, 128, True),
]


def grid_forward_ratio(backend, dtype: torch.dtype, D: int, causal: bool, device: torch.device) -> str:
    q, k, v = (torch.randn(16, 2048 // D, 1024, D, device=device, dtype=dtype) for _ in range(3))
    ours = median_ms(lambda: backend.forward(q, k, v, causal=causal), device, 3, 30)
    with torch.nn.attention.sdpa_kernel(CUDNN):
        cudnn = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), device, 3, 30)
    return f"{str(dtype)[6:]}/{D}/{'c' if causal else 'f'}={cudnn / ours:.3f}({ours * 1e3:.0f}us)"


def main(label: str) -> None:
    device = torch.device("cuda")
    two_kernel, atomic = attnzoo.get("triton_2kernel"), attnzoo.get("triton_atomic")
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=torch.float16) for _ in range(3))
    o, lse = two_kernel.forward(q, k, v, causal=True)
    do = torch.randn_like(o)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step() -> None:
        attnzoo.attention(*leaves, causal=True, backend="triton_2kernel").backward(do)

    for _ in range(5):  # compilation, tuning lookups, the memos' first entries
        two_kernel.forward(q, k, v, causal=True)
        two_kernel.backward(do, q, k, v, o, lse, causal=True)
        atomic.backward(do, q, k, v, o, lse, causal=True)
        step()
    host = {
        "fwd": host_us(lambda: two_kernel.forward(q, k, v, causal=True), device),
        "bwd": host_us(lambda: two_kernel.backward(do, q, k, v, o, lse, causal=True), device),
        "atomic_bwd": host_us(lambda: atomic.backward(do, q, k, v, o, lse, causal=True), device),
        "step": host_us(step, device, 100),
    }
    with torch.nn.attention.sdpa_kernel(CUDNN):
        host["cudnn_fwd"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    ratios = [grid_forward_ratio(two_kernel, dtype, D, causal, device) for dtype, D, causal in GRID_FORWARDS]
    print(label, " ".join(f"{name}={us:.1f}" for name, us in host.items()), "|", " ".join(ratios), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
