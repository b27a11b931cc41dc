"""Host time of one ``triton_2kernel`` forward by stage, and of the Gluon forward's Triton launch by layer
(bench/results/h100_host_probe.log): ``PYTHONPATH=$PWD python3 bench/host_probe.py`` on a Hopper GPU.

Medians of 300 calls with the GPU synchronised before each, at the grids' N = 1k shapes (B = 16, H = 2048 / D) and a
tiny one (B = H = 1, N = 128).  The launch layers: Triton's ``kernel[grid](...)``, its argument binding alone, the
compiled kernel's ``run`` with the bound arguments, and the driver's launch function with the TMA descriptors
encoded beforehand (Triton 3.6's launcher internals).  Last, the forward timed as the grids time it, against cuDNN.
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench import timing
from attnzoo.bench.timing import median_ms
from attnzoo.kernels import forward_gluon, gluon_hopper, launch
from attnzoo.kernels.forward import attention_forward
from attnzoo.validation import validate_forward


def host_us(fn) -> float:
    return timing.host_us(fn, torch.device("cuda"), 300)


def queued_us(fn, n=50, rounds=5):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


class Recorder:
    def __init__(self, fn):
        self.fn = fn
        self.last = None

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.last = (grid, args, kwargs)
            return self.fn[grid](*args, **kwargs)

        return call

    def __getattr__(self, name):
        return getattr(self.fn, name)


def probe(dtype, D, causal, N=1024, B=16):
    H = 2048 // D
    dev = torch.device("cuda")
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
    tiny = [torch.randn(1, 1, 128, D, device=dev, dtype=dtype) for _ in range(3)]
    be = attnzoo.get("triton_2kernel")
    name = f"{str(dtype)[6:]} D={D} causal={causal}"
    for _ in range(3):
        be.forward(q, k, v, causal=causal)
        be.forward(*tiny, causal=causal)
    torch.cuda.synchronize()
    rows = {}
    rows["be.forward grid shape (sync each)"] = host_us(lambda: be.forward(q, k, v, causal=causal))
    rows["be.forward tiny (sync each)"] = host_us(lambda: be.forward(*tiny, causal=causal))
    rows["be.forward tiny (50 queued)"] = queued_us(lambda: be.forward(*tiny, causal=causal))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        rows["sdpa cudnn grid shape (sync each)"] = host_us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        )
    problem = validate_forward(q, k, v, causal, None, None, None, 0.0, None)
    rows["validate_forward"] = host_us(lambda: validate_forward(q, k, v, causal, None, None, None, 0.0, None))
    rows["_check"] = host_us(lambda: be._check(problem))
    rows["prepare"] = host_us(lambda: be.prepare(q, k, v, problem))
    call = be.prepare(q, k, v, problem)
    rows["attention_forward(call)"] = host_us(lambda: attention_forward(call))
    rows["two new_output"] = host_us(
        lambda: (call.new_output((B, H, N, D), dtype), call.new_output((B, H, N), torch.float32))
    )
    rows["gluon_reasons"] = host_us(lambda: call.gluon_reasons(launch.KernelVariant.FORWARD))
    rec = Recorder(forward_gluon.attention_forward_hopper_kernel)
    forward_gluon.attention_forward_hopper_kernel = rec
    attention_forward(call)
    forward_gluon.attention_forward_hopper_kernel = rec.fn
    if rec.last is None:
        print(name, "no Gluon forward ran", file=sys.stderr)
        return name, rows
    grid, args, kwargs = rec.last
    fn = rec.fn
    rows["one tile_descriptor"] = host_us(lambda: gluon_hopper.tile_descriptor(q, 64))
    rows["jit kernel[grid](...)"] = host_us(lambda: fn[grid](*args, **kwargs))
    device = torch.cuda.current_device()
    binder = fn.device_caches[device][4]
    rows["jit binder only"] = host_us(lambda: binder(*args, **kwargs))
    bound = binder(*args, **kwargs)[0]
    ck = fn[grid](*args, **kwargs)
    values = tuple(bound.values())
    import triton

    get_stream = triton.runtime.driver.active.get_current_stream

    def direct():
        ck.run(grid[0], 1, 1, get_stream(device), ck.function, ck.packed_metadata, None, None, None, *values)

    direct()
    rows["CompiledKernel.run direct"] = host_us(direct)
    inner = ck.run.launch
    raw = None
    if inner.__closure__:
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__, strict=True))
        raw = cells["launcher"].cell_contents if "launcher" in cells else None
    if raw is not None:
        from triton.backends.nvidia import driver as nvd

        meta = cells["tensordesc_meta"].cell_contents
        indices = cells["tensordesc_indices"].cell_contents
        final, j = [], 0
        for i, a in enumerate(values):
            if i in indices:
                final.extend(nvd.make_tensordesc_arg(a, meta[j] if meta else None))
                j += 1
            else:
                final.append(a)

        def raw_launch():
            raw(
                grid[0],
                1,
                1,
                get_stream(device),
                ck.function,
                ck.run.launch_cooperative_grid,
                ck.run.launch_pdl,
                None,
                None,
                ck.packed_metadata,
                None,
                None,
                None,
                *final,
            )

        raw_launch()
        rows["raw C launch (descriptors pre-encoded)"] = host_us(raw_launch)
    # grid timing as the bench does (flush before each call), ours and cuDNN's, 3 rounds
    ours, cudnn = [], []
    for _ in range(3):
        ours.append(median_ms(lambda: be.forward(q, k, v, causal=causal), dev, 3, 30))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            cudnn.append(median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), dev, 3, 30))
    rows["grid-timed ours ms x1000"] = statistics.median(ours) * 1e3
    rows["grid-timed cudnn ms x1000"] = statistics.median(cudnn) * 1e3
    print(name, "rounds cudnn/ours:", " ".join(f"{c / o:.2f}" for o, c in zip(ours, cudnn, strict=True)))
    return name, rows


if __name__ == "__main__":
    results = [
        probe(torch.float16, 128, False),
        probe(torch.bfloat16, 128, True),
        probe(torch.float16, 64, True),
        probe(torch.bfloat16, 64, True),
    ]
    for name, rows in results:
        print(f"# {name}")
        for label, us in rows.items():
            print(f"  {label:45s} {us:8.1f} us")
