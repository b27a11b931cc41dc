"""Where one training step through ``attnzoo.attention`` spends its host time (bench/results/h100_step_host_gaps.log):
``PYTHONPATH=$PWD python3 bench/step_host_gaps.py`` on a GPU.

Timestamps at the step's start, the backend's ``forward_validated`` (inside the forward operator), ``attention``'s
return, the backward operator's call in the autograd formula, the backend's ``backward_validated`` inside it, and
``backward()``'s return; medians over 200 steps (tiny shapes: B = H = 1, N = 128, D = 64, fp16, causal,
``triton_2kernel``), with autograd's device threads on and off, then the two backend calls alone.  Eager calls take
the autograd Function (``attnzoo.autograd._EagerAttention``) now; the script sends them through the operators, whose
time the log measured.
"""

import itertools
import statistics
import threading
import time

import torch

import attnzoo
import attnzoo.autograd as autograd_module
from attnzoo.validation import validate_forward

ORDER = ["start", "fwd_in", "fwd_out", "attn_out", "bop_in", "bwd_in", "bwd_out", "bop_out", "end"]


def main() -> None:
    device = torch.device("cuda")
    backend = attnzoo.get("triton_2kernel")
    marks: dict[str, float] = {}
    forward_validated, backward_validated = backend.forward_validated, backend.backward_validated
    backward_op = autograd_module.attention_backward_op

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            marks[f"{name}_in"] = time.perf_counter()
            result = fn(*args, **kwargs)
            marks[f"{name}_out"] = time.perf_counter()
            marks[f"{name}_thread"] = threading.get_ident() == threading.main_thread().ident
            return result

        return wrapper

    backend.forward_validated = timed("fwd", forward_validated)
    backend.backward_validated = timed("bwd", backward_validated)
    autograd_module.attention_backward_op = timed("bop", backward_op)
    autograd_module._plain_eager = lambda *tensors: False  # the operators, as every call took them then
    q, k, v = (torch.randn(1, 1, 128, 64, device=device, dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        gaps: dict[str, list[float]] = {f"{a}->{b}": [] for a, b in itertools.pairwise(ORDER)}
        for step in range(230):
            torch.cuda.synchronize()
            marks["start"] = time.perf_counter()
            out = attnzoo.attention(*leaves, causal=True, backend="triton_2kernel")
            marks["attn_out"] = time.perf_counter()
            out.backward(do)
            marks["end"] = time.perf_counter()
            if step >= 30:
                for a, b in itertools.pairwise(ORDER):
                    gaps[f"{a}->{b}"].append((marks[b] - marks[a]) * 1e6)
        total = sum(statistics.median(g) for g in gaps.values())
        print(f"multithreading={threads} backward on main thread={marks['bwd_thread']} sum of medians {total:.0f} us")
        for name, values in gaps.items():
            print(f"  {name:22s} {statistics.median(values):8.1f} us")
    torch.autograd.set_multithreading_enabled(True)
    times = []
    for _ in range(230):
        torch.cuda.synchronize()
        start = time.perf_counter()
        o, lse = forward_validated(q, k, v, validate_forward(q, k, v, True))
        backward_validated(do, q, k, v, o, lse, validate_forward(q, k, v, True))
        times.append((time.perf_counter() - start) * 1e6)
    print(f"direct forward_validated + backward_validated {statistics.median(times[30:]):.0f} us")


if __name__ == "__main__":
    main()
