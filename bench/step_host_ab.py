"""One round of a host-time A/B of a training step and a no-grad forward through ``attnzoo.attention``
(bench/results/h100_eager_function_step_ab.log), in this process: host microseconds per call, medians of 300 calls
with the GPU synchronised before each (B = H = 1, N = 128, D = 64, fp16, causal, ``triton_2kernel``).  Fresh
processes, the trees alternating:

    for r in 1 2 3; do
        PYTHONPATH=/path/to/old python3 bench/step_host_ab.py old
        PYTHONPATH=$PWD python3 bench/step_host_ab.py new
    done
"""

import sys

import torch

import attnzoo
from attnzoo.bench.timing import host_us


def main(label: str) -> None:
    device = torch.device("cuda")
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step() -> None:
        attnzoo.attention(*leaves, causal=True, backend="triton_2kernel").backward(do)

    def forward_no_grad() -> None:
        with torch.no_grad():
            attnzoo.attention(q, k, v, causal=True, backend="triton_2kernel")

    for _ in range(10):  # compilation, the memos' first entries
        step()
        forward_no_grad()
    step_us, forward_us = host_us(step, device, 300), host_us(forward_no_grad, device, 300)
    print(label, f"step={step_us:.0f} no_grad_fwd={forward_us:.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
