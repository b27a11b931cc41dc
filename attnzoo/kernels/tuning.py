"""Launch configurations of the Triton kernels and the autotuner that picks among them.

Each kernel has a short list of candidate :class:`KernelConfig` (BLOCK_M query rows, BLOCK_N keys, warps,
software-pipelining stages, TMA loads), pruned by an estimate of the shared memory they need.  The autotuner
times the survivors once per *key* (the kernel, head-dim tile, dtype, causal, seqlens_k, and power-of-two
buckets of Nq and Nk: what changes the best choice), times the close ones again, and caches the winner.  It is
written here instead of using ``triton.autotune`` so that kernels that accumulate with atomics get their
buffers zeroed before the final launch in every Triton version, and so that ``ATTNZOO_AUTOTUNE=0``
can switch tuning off.

Under the Triton interpreter every kernel uses one small fixed config (16 x 16) so that CPU tests stay fast.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources


@dataclass(frozen=True)
class KernelConfig:
    """BLOCK_M: query rows per tile; BLOCK_N: keys per tile; num_warps; num_stages (pipelining depth).

    tma (forward and dQ kernel): load the K/V tiles of the unmasked stage through tensor descriptors (Hopper's
    TMA copy engine) where the inputs allow it (``launch.descriptor_loads_possible``), else through pointers.
    gluon (forward, dK/dV kernel): run the Gluon Hopper kernel (``forward_gluon.py``, ``backward_gluon.py``;
    NUM_STAGES = num_stages) where the call is in its scope (``LaunchContext.hopper_reasons``), else the Triton kernel
    with the same tiles.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    gluon: bool = False

    def __str__(self) -> str:
        flags = (" tma" if self.tma else "") + (" gluon" if self.gluon else "")
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}{flags}"


INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1)

# First entry = the default when autotuning is off.  Hopper: 8 warps (two warpgroups) for 128-row tiles.
CANDIDATES: dict[str, list[KernelConfig]] = {
    "forward": [
        KernelConfig(128, 64, 8, 3),
        KernelConfig(128, 64, 8, 4),
        KernelConfig(128, 128, 8, 2),
        KernelConfig(128, 128, 8, 3),
        KernelConfig(128, 32, 4, 3),
        KernelConfig(64, 64, 4, 3),
        KernelConfig(64, 32, 4, 2),
        # TMA loads of K/V: up to +4% in the non-causal forward on the H100, -8% at D=128 causal 128 x 128
        # (docs/design.md), so both kinds stay candidates.
        KernelConfig(128, 128, 8, 3, tma=True),
        KernelConfig(128, 64, 8, 3, tma=True),
        KernelConfig(128, 64, 8, 4, tma=True),
        # The Gluon Hopper forward (softmax overlapped with P V). 64-row tiles (one warpgroup loading its own tiles)
        # leave room for two or three CTAs per SM, whose phases interleave: at D = 64, 64 x 128 w4 won every point
        # (docs/design.md). 128-row tiles are warp-specialised (a producer warp, two warpgroups out of step):
        # at D = 128 they ran 1.15-1.25x the best 64-row tile (fp16, N = 2k and 8k).
        KernelConfig(64, 128, 4, 2, gluon=True),
        KernelConfig(64, 64, 4, 2, gluon=True),
        KernelConfig(64, 64, 4, 3, gluon=True),
        KernelConfig(128, 128, 8, 2, gluon=True),
        KernelConfig(128, 128, 8, 3, gluon=True),
    ],
    # K/V-stationary dK/dV: BLOCK_N keys resident, BLOCK_M query rows streamed.
    # Order: measured fastest first at fp16 D=128 N=2048 on the H100 (docs/design.md).
    "dkdv": [
        KernelConfig(32, 64, 4, 3),
        KernelConfig(32, 128, 8, 3),
        KernelConfig(64, 128, 8, 2),
        KernelConfig(64, 128, 8, 3),
        KernelConfig(16, 64, 4, 2),
        KernelConfig(64, 64, 4, 3),
        # D = 64: 4 warps over 128 resident keys, 14% faster than (32, 64) at fp16 N = 8192 (NOTES-kernels.md).
        KernelConfig(32, 128, 4, 3),
        # The Gluon Hopper dK/dV kernel (softmax-gradient arithmetic overlapped with the products; BLOCK_N = 16 *
        # num_warps: one warpgroup per 64 resident keys). On the H100, fp16, the whole backward with 64 x 64 w4 s2
        # (two CTAs per SM) ran 1.02-1.07x the best Triton tile at D = 128 and 0.84-0.96x at D = 64; 64 x 128 w8 s2
        # 0.95-1.00x at D = 128; 32-row tiles and 3 stages were slower (docs/design.md).
        KernelConfig(64, 64, 4, 2, gluon=True),
        KernelConfig(64, 128, 8, 2, gluon=True),
    ],
    # Q-stationary dQ: BLOCK_M query rows resident, BLOCK_N keys streamed.
    "dq": [
        KernelConfig(128, 64, 8, 3),
        KernelConfig(128, 32, 8, 3),
        KernelConfig(128, 128, 8, 2),
        KernelConfig(64, 64, 4, 3),
        KernelConfig(64, 32, 4, 2),
        KernelConfig(128, 64, 4, 3),
        # K/V of the unmasked stage through TMA, as in the forward: +0.3 to +5.4% (median +2.1%) over the same tiles
        # with pointer loads, in the whole fp16 backward on the H100 (D = 64 and 128, full and causal, 24 pinned
        # tile pairs; docs/design.md).
        KernelConfig(128, 64, 8, 3, tma=True),
        KernelConfig(64, 64, 4, 3, tma=True),
    ],
    # Q-stationary backward with atomic dK/dV.
    "atomic": [
        KernelConfig(64, 64, 4, 2),
        KernelConfig(128, 64, 8, 2),
        KernelConfig(64, 128, 8, 2),
        KernelConfig(128, 32, 8, 3),
        KernelConfig(32, 64, 4, 2),
    ],
}


def shared_memory_estimate(kernel: str, cfg: KernelConfig, block_d: int, itemsize: int) -> int:
    """Bytes of shared memory a config needs, roughly: resident tiles + num_stages buffers per streamed tile."""
    m, n, s = cfg.block_m, cfg.block_n, cfg.num_stages
    if kernel == "forward":  # Q resident, K and V streamed.
        return itemsize * block_d * (m + 2 * n * s)
    if kernel == "dkdv":  # K, V resident; Q and dO streamed; P^T and dS^T staged for the dots.
        return itemsize * (block_d * (2 * n + 2 * m * s) + 2 * m * n)
    # dq, atomic: Q and dO resident; K and V streamed; dS (and P^T) staged for the dots.
    return itemsize * (block_d * (2 * m + 2 * n * s) + 2 * m * n)


@functools.cache
def _shared_memory_limit_of(index: int) -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return int(props["max_shared_mem"])


def _shared_memory_limit(device: torch.device) -> int:
    return _shared_memory_limit_of(device.index or 0)


def candidates(kernel: str, block_d: int, dtype: torch.dtype, device: torch.device) -> list[KernelConfig]:
    """The configs of ``kernel`` that fit the device's shared memory (at least the smallest one)."""
    configs = CANDIDATES[kernel]
    limit = _shared_memory_limit(device)
    itemsize = dtype.itemsize
    fitting = [c for c in configs if shared_memory_estimate(kernel, c, block_d, itemsize) <= limit]
    if fitting:
        return fitting
    # Nothing fits by the estimate: keep the smallest and let the compiler decide.
    return [min(configs, key=lambda c: shared_memory_estimate(kernel, c, block_d, itemsize))]


def autotune_enabled() -> bool:
    """``ATTNZOO_AUTOTUNE=0`` turns tuning off (the first fitting candidate is used)."""
    return os.environ.get("ATTNZOO_AUTOTUNE", "1") not in ("0", "")


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in integer arithmetic: it runs twice per kernel launch, and
    ``triton.next_power_of_2`` costs several microseconds of host time per call."""
    return 1 << max(n - 1, 0).bit_length()


def head_dim_tile(head_dim: int) -> int:
    """The padded head-dim tile (BLOCK_D): the next power of two, at least 16 (``tl.dot``'s smallest K)."""
    return max(16, _next_power_of_2(head_dim))


def seqlen_bucket(n: int) -> int:
    """Power-of-two bucket of a sequence length (64 .. 16384): the best tile changes with N only slowly."""
    return min(max(64, _next_power_of_2(n)), 16384)


# Screening: every candidate is timed once (the first after WARMUP_MS of its untimed runs, the others after 10 ms), then
# those within SCREEN_AGAIN_WITHIN of the fastest once more in reverse order; each counts with the faster of its two
# timings.  Candidates within RETIME_WITHIN of the fastest (at most RETIME_MAX of them) are then timed RETIME_ROUNDS
# more times, in alternating order; each of those counts with the median of its rounds.
WARMUP_MS = 50.0
SCREEN_AGAIN_WITHIN = 0.5
RETIME_WITHIN = 0.10
RETIME_MAX = 4
RETIME_ROUNDS = 3


class Autotuner:
    """Time each candidate per key, re-time the close ones, keep the fastest.

    One timing per candidate does not separate candidates a few percent apart: on the H100 the order of close
    candidates changed from one tuning to the next (fp16 D=64 N=8192: a dK/dV tile 4% slower than the best was
    picked in two tunings of three; with the re-timing, the best in all three; docs/design.md).  Timing
    the close ones in alternating rounds spreads any drift of the GPU's state over all of them.  All candidates
    are compiled before any is timed, so that no timing follows a second of idle GPU (compilation is host work).
    One timing can also be far off: a grid's tuning timed the dQ tile that won every other D=128 key 18-20% slow at
    fp16 N=16k, outside the re-timing's 10%, and the backward there lost 5-6% (docs/design.md).  So the
    screening times every plausible candidate twice, the second time in reverse order (after other neighbours),
    and keeps its faster timing: a timing is rarely too fast, while a slow phase of the GPU makes it too slow.
    ``reset`` runs before every timed and final launch.
    """

    def __init__(self) -> None:
        self.best: dict[tuple, KernelConfig] = {}
        self.timings: dict[tuple, dict[KernelConfig, float]] = {}
        self.screens: dict[tuple, dict[KernelConfig, list[float]]] = {}

    def choose(
        self,
        key: tuple,
        configs: list[KernelConfig],
        launch: Callable[[KernelConfig], None],
        reset: Callable[[], None] | None,
    ) -> KernelConfig:
        if key in self.best:
            return self.best[key]
        if len(configs) == 1 or not autotune_enabled():
            self.best[key] = configs[0]
            return configs[0]

        def trial(cfg: KernelConfig) -> None:
            if reset is not None:
                reset()
            launch(cfg)

        def time_of(cfg: KernelConfig, rep: int, warmup: float = 10.0) -> float:
            return triton.testing.do_bench(lambda: trial(cfg), warmup=warmup, rep=rep, return_mode="median")

        runnable = []
        for cfg in configs:
            try:
                trial(cfg)  # compile outside the timing
            except OutOfResources:
                continue
            runnable.append(cfg)
        if not runnable:
            raise RuntimeError(f"no launch configuration of {key[0]} fits this device; tried {configs}")
        screens = {cfg: [time_of(cfg, rep=40, warmup=WARMUP_MS if cfg is runnable[0] else 10.0)] for cfg in runnable}
        fastest = min(times[0] for times in screens.values())
        for cfg in reversed(runnable):
            if screens[cfg][0] <= fastest * (1 + SCREEN_AGAIN_WITHIN):
                screens[cfg].append(time_of(cfg, rep=25))
        timings = {cfg: min(times) for cfg, times in screens.items()}
        fastest = min(timings.values())
        close = sorted((c for c in timings if timings[c] <= fastest * (1 + RETIME_WITHIN)), key=timings.get)
        close = close[:RETIME_MAX]
        if len(close) > 1:
            rounds: dict[KernelConfig, list[float]] = {cfg: [] for cfg in close}
            for _ in range(RETIME_ROUNDS):
                for cfg in close:
                    rounds[cfg].append(time_of(cfg, rep=25))
            timings.update({cfg: statistics.median(times) for cfg, times in rounds.items()})
        best = min(timings, key=timings.get)
        self.best[key], self.timings[key], self.screens[key] = best, timings, screens
        return best

    def describe(self, key: tuple) -> str:
        """One line for a tuned key: the candidates fastest first, each as its time over the fastest's, followed by
        its screening timings on the same scale in brackets (a large gap between them flags a noisy GPU)."""
        timings = sorted(self.timings[key].items(), key=lambda item: item[1])
        fastest = timings[0][1]
        screens = self.screens[key]
        ranked = ", ".join(
            f"{c} {t / fastest:.2f} [{' '.join(f'{s / fastest:.2f}' for s in screens[c])}]" for c, t in timings
        )
        kernel, block_d, dtype, causal, has_seqlens, nq, nk = key[:7]
        return (
            f"{kernel} BLOCK_D={block_d} {str(dtype).removeprefix('torch.')} causal={causal} "
            f"seqlens={has_seqlens} Nq<={nq} Nk<={nk}: {ranked}"
        )


AUTOTUNER = Autotuner()
