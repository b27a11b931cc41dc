"""Median timings: CUDA events on the GPU, ``time.perf_counter`` on the CPU; and the allocator's peak memory.

As in ``triton.testing.do_bench``, each timed GPU call is preceded by a write over a buffer larger than the
L2 cache (50 MB on an H100), outside the timed region, so that no call finds the previous one's data cached.
Warm-up calls (compilation, autotuning, handle creation) are never timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffers: dict[str, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _flush_buffers[key]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Host seconds of one call, device work included (for the too-slow guard, not for the results)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def host_us(fn: Callable[[], Any], device: torch.device, calls: int = 200) -> float:
    """Median host microseconds of one call of ``fn``, the device synchronised before each (so that no queue of
    earlier work holds the call back): the time the host spends issuing it."""
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    synchronize(device)
    return statistics.median(times) * 1e6


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeat: int, warmup_ms: float = 0.0) -> float:
    """Median milliseconds of ``repeat`` calls of ``fn`` after untimed calls: at least ``warmup`` of them, and more
    until they have run for ``warmup_ms``.

    The time floor is for the GPU's state, not for caches: on the H100 a timing taken right after autotuning (a
    few seconds of back-to-back kernels) ran 3-14% slower than the same timing repeated tens of milliseconds
    later, while a second of idling before a timing changed nothing (bench/README.md).
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn()
        synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    flush = _flush_buffer(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def reset_peak(device: torch.device) -> int:
    """Start a peak-memory window; returns the bytes allocated now (the baseline to subtract)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_mb_since(device: torch.device, baseline: int) -> float | None:
    """Peak MB allocated above ``baseline`` since :func:`reset_peak`; None on the CPU (no allocator counter).

    On the CPU, torch's allocator has no peak counter and ``tracemalloc`` sees only NumPy's buffers, not
    torch's, so the column is left empty rather than filled with a number that means something else per backend.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - baseline) / 2**20


def release_memory(device: torch.device) -> None:
    """Give cached blocks back after an out-of-memory error, so that the next case starts clean."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
