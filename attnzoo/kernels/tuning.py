"""Launch configurations of the Triton kernels, and the tuner that picks one per call.

Each kernel has a short list of candidate :class:`KernelConfig` (BLOCK_M query rows, BLOCK_N keys, warps,
software-pipelining stages, TMA loads, Gluon), pruned by an estimate of the shared memory they need.  A config is
chosen per *key*: the kernel variant, head-dim tile, dtype, causal, seqlens_k, power-of-two buckets of Nq and Nk and
the dot precision (what changes the best choice).  :func:`launch_with_best` is the one entry point of the launch
layer; for a key it looks, in order, at

1. the configs chosen earlier in this process (the common case: a dict lookup);
2. the user's disk cache: one small JSON per GPU model, compute capability, Triton version and attnzoo version, under
   ``$ATTNZOO_CACHE_DIR`` (else ``$XDG_CACHE_HOME/attnzoo``, else ``~/.cache/attnzoo``), read once per process;
3. the table shipped in ``attnzoo/tuning_data/`` for the running GPU's model (measured by ``attnzoo bench``; any
   Triton version);
4. with ``ATTNZOO_AUTOTUNE=1`` or inside :func:`autotuning`: timing every candidate (:class:`Autotuner`), and
   storing the winner on disk for every later process;
5. otherwise the heuristic pick (:func:`heuristic_pick`): one config compiled, nothing timed.

``ATTNZOO_AUTOTUNE=0`` (or unset) never times.  Inside ``autotuning()`` steps 2 and 3 are skipped: every key is
timed afresh once and its winner stored (``python -m attnzoo tune``, the benchmark).  A remembered config that no
longer launches (out of shared memory or registers: another specialisation of the key) falls back to the next
candidate that does.  The tuner is written here rather than with ``triton.autotune`` so that kernels that
accumulate with atomics get their buffers zeroed before every launch in every Triton version.

Under the Triton interpreter every kernel uses one small fixed config (16 x 16) so that CPU tests stay fast.
Triton is imported only when a kernel is tuned or launched, so that this module (and ``KernelConfig``) loads without
it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import statistics
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch

from .._env import autotune_requested, cache_dir
from .gluon_hopper import dq_stage_slots, head_dim_parts

_CONFIG_TEXT = re.compile(r"(\d+)x(\d+) w(\d+) s(\d+)((?: (?:tma|gluon|persistent))*)")


@dataclass(frozen=True)
class KernelConfig:
    """BLOCK_M: query rows per tile; BLOCK_N: keys per tile; num_warps; num_stages (pipelining depth).

    tma (forward and dQ kernel): load the K/V tiles of the unmasked stage through tensor descriptors (Hopper's
    TMA copy engine) where the inputs allow it (``launch.descriptor_loads_possible``), else through pointers.
    gluon (forward, dK/dV and atomic kernels): run the Gluon Hopper kernel (``forward_gluon.py``, ``backward_gluon.py``;
    NUM_STAGES = num_stages) where the call is in its scope (``KernelVariant.gluon_scope``), else the Triton kernel
    with the same tiles.  persistent (with gluon, 128-row forward tiles): one program per SM runs Q blocks in turn.
    ``str(cfg)`` reads ``"128x64 w8 s3 tma"``; :meth:`parse` reads it back.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    gluon: bool = False
    persistent: bool = False

    def __str__(self) -> str:
        flags = (
            (" tma" if self.tma else "") + (" gluon" if self.gluon else "") + (" persistent" if self.persistent else "")
        )
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}{flags}"

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """The config written as ``str(cfg)``, e.g. ``"128x64 w8 s3 tma gluon"``; ValueError on other text."""
        if not isinstance(text, str):
            raise TypeError(f"a kernel config must be a KernelConfig or its text, got {type(text).__name__}")
        match = _CONFIG_TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"kernel config {text!r} is not of the form 'BLOCK_MxBLOCK_N wWARPS sSTAGES[ tma][ gluon]' "
                "(e.g. '128x64 w8 s3 tma')"
            )
        block_m, block_n, warps, stages = (int(g) for g in match.groups()[:4])
        flags = match.group(5).split()
        if len(set(flags)) != len(flags):
            raise ValueError(f"kernel config {text!r} repeats a flag")
        for name, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("warps", warps)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"kernel config {text!r}: {name} must be a power of two, got {value}")
        if stages < 1:
            raise ValueError(f"kernel config {text!r}: stages must be at least 1, got {stages}")
        if "persistent" in flags and not ("gluon" in flags and block_m == 128):
            raise ValueError(f"kernel config {text!r}: persistent is a flag of the 128-row gluon tiles")
        return cls(
            block_m,
            block_n,
            warps,
            stages,
            tma="tma" in flags,
            gluon="gluon" in flags,
            persistent="persistent" in flags,
        )


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
        # The 128-row tile that fits the shared memory at D = 256 (a 64 x 256 float32 O per warpgroup, held in the
        # 232-248 registers that setmaxnreg gives the consumers): 1.26-1.53x the 64-row tiles there (docs/design.md).
        KernelConfig(128, 64, 8, 2, gluon=True),
        # Persistent: one program per SM runs Q blocks in turn, the next block's first K/V tile (and, where a second
        # set of Q slots fits, its Q rows) loading under this one (short sequences and windows of 257-1024 keys, where
        # a block has few K/V tiles and its prologue and epilogue weigh).  On the H100 it won every D = 128 key at
        # N = 1k and 2k and every key of a 1024-key window, and D = 192 full (docs/design.md).
        KernelConfig(128, 128, 8, 2, gluon=True, persistent=True),
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
        # D = 64: 4 warps over 128 resident keys, 14% faster than (32, 64) at fp16 N = 8192 (docs/design.md).
        KernelConfig(32, 128, 4, 3),
        # BLOCK_D = 256 (D = 192 and 256): a dK/dV tile that ptxas compiles without spills there (252 registers,
        # 103 KB of shared memory; 32 resident keys run mma.sync, not wgmma, whose M is 64 per warpgroup).  It fits
        # Dv = 256; at Dv = 128 it took 1.9-2.3x the time of 32x128 w8 s3, which spills (WIDE_HEURISTIC_ORDER).
        KernelConfig(64, 32, 8, 2),
        # The Gluon Hopper dK/dV kernel (softmax-gradient arithmetic overlapped with the products; BLOCK_N = 16 *
        # num_warps: one warpgroup per 64 resident keys). On the H100, fp16, the whole backward with 64 x 64 w4 s2
        # (two CTAs per SM) ran 1.02-1.07x the best Triton tile at D = 128 and 0.84-0.96x at D = 64; 32-row tiles and
        # 3 stages were slower (docs/design.md).  The 128-key tile is warp-specialised (two warpgroups and a producer
        # warp, ``backward_gluon.dkdv_warp_specialized``): 0.97-1.03x the 64-key tile at D = 128 (the five-product
        # backward builds on it).
        KernelConfig(64, 64, 4, 2, gluon=True),
        KernelConfig(64, 128, 8, 2, gluon=True),
        # Q tiles of 128 rows at D <= 64 (``fits_head_dim`` drops it above): half the iterations, each with S^T and
        # dP^T of 64 registers a thread beside dK and dV of 32 (no spills in ptxas, two CTAs per SM).  On the H100
        # the backward ran 0.98-1.09x the shipped tiles' at D = 64 and 1.06-1.08x on a packed batch
        # (docs/design.md).  At D = 128 the four accumulators would take 256 registers (ptxas: 768 B of spills).
        KernelConfig(128, 64, 4, 2, gluon=True),
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
        # The Gluon Hopper dQ kernel (``backward_gluon_dq.py``: the softmax-gradient arithmetic overlapped with the
        # products; BLOCK_M = 16 * num_warps, one warpgroup per 64 rows; three slots give each K/V copy an
        # iteration of lead).
        KernelConfig(128, 64, 8, 3, gluon=True),
        KernelConfig(64, 64, 4, 2, gluon=True),
        KernelConfig(64, 64, 4, 3, gluon=True),
    ],
    # Q-stationary backward with atomic dK/dV.
    "atomic": [
        KernelConfig(64, 64, 4, 2),
        KernelConfig(128, 64, 8, 2),
        KernelConfig(64, 128, 8, 2),
        KernelConfig(128, 32, 8, 3),
        KernelConfig(32, 64, 4, 2),
        # BLOCK_D = 256: the tile with the fewest spill bytes in ptxas (268 B; the others above that fit spill 3.8-6.5
        # KB there).
        KernelConfig(128, 32, 8, 2),
        # On Hopper (``KernelVariant.ATOMIC_PREPROCESS.gluon_scope``): the Gluon dK/dV kernel, K/V-stationary, that
        # also adds each Q tile's dQ share atomically (five products per tile instead of the two kernels' seven).
        # The 128-key tile is warp-specialised (``dkdv_warp_specialized``).
        KernelConfig(64, 128, 8, 2, gluon=True),
        KernelConfig(64, 64, 4, 2, gluon=True),
    ],
}


def shared_memory_estimate(
    kernel: str, cfg: KernelConfig, block_d: int, itemsize: int, block_dv: int | None = None
) -> int:
    """Bytes of shared memory a config needs, roughly: resident tiles + num_stages buffers per streamed tile.
    ``block_dv``: the tile width of v, o and do where it differs from ``block_d`` (Dv != D)."""
    m, n, s = cfg.block_m, cfg.block_n, cfg.num_stages
    dv = block_dv or block_d
    if kernel == "forward":  # Q resident, K and V streamed.
        return itemsize * (block_d * (m + n * s) + dv * n * s)
    if kernel == "dkdv" or (kernel == "atomic" and cfg.gluon):
        # K, V resident; Q and dO streamed; P^T and dS^T staged for the dots (the Gluon kernel keeps both in
        # registers, and its five-product build stages dS^T only, in two slots when warp-specialised) and, for the
        # five-product build, the float32 dQ share staged for its TMA reductions; the Gluon kernel's lse2/Delta
        # slots (two warpgroups' at most) and mbarriers.
        # (The warp-specialised 128-key block stages each warpgroup's share, half of D at D = 128 and all of D at
        # D = 64, in dq_stage_slots tiles: in D-wide tiles, one per slot at D = 128 and two at D = 64.)
        shares = dq_stage_slots(block_d) * (1 if block_d >= 128 else 2) if cfg.num_warps == 8 else 1
        dq_staging = 0 if kernel != "atomic" else 4 * m * block_d * shares
        statistics = 32 * m + 1024 if cfg.gluon else 0
        return itemsize * ((block_d + dv) * (n + m * s) + 2 * m * n) + dq_staging + statistics
    # dq, atomic: Q and dO resident; K and V streamed; dS (and P^T) staged for the dots.
    return itemsize * ((block_d + dv) * (m + n * s) + 2 * m * n)


@functools.cache
def _shared_memory_limit_of(index: int) -> int:
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return int(props["max_shared_mem"])


def shared_memory_limit(device: torch.device) -> int:
    """The shared memory one CTA may hold on ``device`` (bytes; Triton's ``max_shared_mem``)."""
    return _shared_memory_limit_of(device.index or 0)


# The one tile of the Gluon dK/dV and dQ kernels above D = 128 (``backward_gluon_wide``): 64 keys or rows a block,
# launched with one warpgroup (the kernels add the other and the producer warp), two ring slots.
WIDE_GLUON_TILE = KernelConfig(64, 64, 4, 2, gluon=True)


def fits_head_dim(kernel: str, cfg: KernelConfig, block_d: int) -> bool:
    """Whether ``cfg`` of ``CANDIDATES[kernel]`` is a candidate at the head-dim tile ``block_d`` at all (before the
    shared memory): the 128-row Gluon dK/dV tile is one up to 64 only (its accumulators' registers), and above 128
    the Gluon dK/dV and dQ kernels are ``backward_gluon_wide``'s, built for 64 x 64 tiles in two ring slots."""
    if kernel == "dkdv" and cfg.gluon and cfg.block_m > 64 and block_d > 64:
        return False
    if kernel in ("dkdv", "dq") and cfg.gluon and block_d > 128:
        return cfg == WIDE_GLUON_TILE
    return True


def gluon_shared_memory_estimate(kernel: str, cfg: KernelConfig, d: int, dv: int, itemsize: int) -> int:
    """``shared_memory_estimate`` of a ``gluon`` config at exactly D = ``d`` and Dv = ``dv`` (the Gluon tiles hold
    192 as 128 + 64), with the forward's own O rows where O does not leave through Q's (FP8: a bfloat16 O and two
    e4m3 P slots per warpgroup).  A persistent forward's one set of Q slots; ``forward_gluon.persistent_q_sets``
    adds the second where it fits."""
    tiles = shared_memory_estimate(kernel, cfg, d, itemsize, dv)
    if kernel == "forward" and itemsize == 1:
        tiles += 2 * cfg.block_m * dv + 2 * cfg.block_m * cfg.block_n
    elif kernel == "forward" and dv != head_dim_parts(d)[0]:
        tiles += itemsize * cfg.block_m * dv
    return tiles


def candidates(
    kernel: str,
    block_d: int,
    dtype: torch.dtype,
    device: torch.device,
    gluon_head_dims: tuple[int, int] | None = None,
    block_dv: int | None = None,
) -> list[KernelConfig]:
    """The configs of ``kernel`` that fit the device's shared memory (at least the smallest one).

    ``block_dv``: the Triton kernels' tile of v, o and do where Dv != D.  ``gluon_head_dims``: ``(D, Dv)`` where
    the call is in the Gluon kernel's scope: its tiles hold exactly D and Dv columns (192 as 128 + 64, not the Triton
    kernels' power-of-two tile of 256), and its configs fit by those."""
    configs = [c for c in CANDIDATES[kernel] if fits_head_dim(kernel, c, block_d)]
    limit = shared_memory_limit(device)
    itemsize = dtype.itemsize

    def estimate(cfg: KernelConfig) -> int:
        if cfg.gluon and gluon_head_dims is not None:
            return gluon_shared_memory_estimate(kernel, cfg, *gluon_head_dims, itemsize)
        return shared_memory_estimate(kernel, cfg, block_d, itemsize, block_dv)

    fitting = [c for c in configs if estimate(c) <= limit]
    if fitting:
        return fitting
    # Nothing fits by the estimate: keep the smallest and let the compiler decide.
    return [min(configs, key=estimate)]


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
        self.sources: dict[tuple, str] = {}  # where each best config came from: "timed", "disk", "shipped", ...
        self.timings: dict[tuple, dict[KernelConfig, float]] = {}
        self.screens: dict[tuple, dict[KernelConfig, list[float]]] = {}
        self.store = WinnerStore()

    def forget(self, key: tuple) -> None:
        """Drop the remembered config of ``key`` (it no longer launches)."""
        self.best.pop(key, None)
        self.sources.pop(key, None)

    def resolve(
        self,
        key: tuple,
        configs: list[KernelConfig],
        launch: Callable[[KernelConfig], None],
        reset: Callable[[], None] | None,
    ) -> KernelConfig:
        """The config of a key seen for the first time in this process (the lookup order of the module docstring)."""
        timing = _timing_requested() and _times_kernel(key[0])
        if not (_forced_timing is True and timing):  # inside autotuning() every key it times is timed afresh
            identity = _device_identity(key[-1])
            if identity is not None:
                text = key_text(key)
                for source, winners in (("disk", self.store.winners(identity)), ("shipped", shipped_winners(identity))):
                    cfg = _known_config(winners.get(text), configs)
                    if cfg is not None:
                        self.best[key], self.sources[key] = cfg, source
                        return cfg
        if timing:
            cfg = self.choose(key, configs, launch, reset)
            self.sources[key] = "timed"
            identity = _device_identity(key[-1])
            if identity is not None:
                self.store.save(identity, key_text(key), cfg)
            return cfg
        modifiers = key_modifiers(key)
        cfg = heuristic_pick(key[0], key[1], configs, "softcap" in modifiers.split(), window_span(modifiers))
        self.best[key], self.sources[key] = cfg, "heuristic"
        return cfg

    def choose(
        self,
        key: tuple,
        configs: list[KernelConfig],
        launch: Callable[[KernelConfig], None],
        reset: Callable[[], None] | None,
    ) -> KernelConfig:
        """Time ``configs`` for ``key`` (all compiled first, then screened and re-timed) and keep the fastest."""
        import triton.testing
        from triton.runtime.errors import OutOfResources

        if len(configs) == 1:
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
        return f"{key_text(key)}: {ranked}"


def autotune_enabled() -> bool:
    """Whether keys without a stored winner are timed (``ATTNZOO_AUTOTUNE=1`` or inside ``autotuning()``)."""
    return _timing_requested()


def _launched(cfg: KernelConfig, launch: Callable[[KernelConfig], None], reset: Callable[[], None] | None) -> bool:
    """Launch ``cfg`` after ``reset``; False if it does not fit the device (out of shared memory or registers)."""
    from triton.runtime.errors import OutOfResources

    try:
        if reset is not None:
            reset()
        launch(cfg)
    except OutOfResources:
        return False
    return True


def launch_with_best(
    key: tuple,
    configs_of: Callable[[], list[KernelConfig]],
    launch: Callable[[KernelConfig], None],
    reset: Callable[[], None] | None = None,
) -> KernelConfig:
    """Launch ``key``'s config (remembered, stored, shipped, timed or the heuristic pick); returns the config that ran.

    ``key``: ``(variant, BLOCK_D, dtype, causal, has_seqlens_k, Nq bucket, Nk bucket, dot precision, device index)``.
    ``configs_of`` gives the candidates that fit and are in scope for this call (only built on a key's first call).
    ``reset`` zeroes accumulation buffers; it runs before every launch, timing trials included, so that no kernel
    ever adds into a buffer that an earlier launch left partial sums in.
    """
    tuner = AUTOTUNER
    cfg = tuner.best.get(key)
    if cfg is not None:  # chosen by an earlier call, and launched then: the common case, kept short
        if _launched(cfg, launch, reset):
            return cfg
        tuner.forget(key)  # another specialisation of this key (say, another head dim) needs more
    configs = configs_of()
    cfg = tuner.resolve(key, configs, launch, reset)
    # The shared-memory estimate is rough: if the chosen config does not fit after all, take the next.
    for fallback in [cfg] + [c for c in configs if c != cfg]:
        if _launched(fallback, launch, reset):
            tuner.best[key] = fallback
            return fallback
    tuner.forget(key)
    raise RuntimeError(f"no launch configuration of {key[0]} fits this device; tried {', '.join(map(str, configs))}")


def key_modifiers(key: tuple) -> str:
    """What a tuning key holds between the precision and the device index: the score modifiers and Dv
    (``launch.ScoreModifiers.key``) and the head-dim and FP8 notes, as space-separated words ("" for a plain call)."""
    return " ".join(str(part) for part in key[8:-1] if part)


def key_text(key: tuple) -> str:
    """The readable, device-independent text of a tuning key: the disk cache's and the shipped table's keys."""
    variant, block_d, dtype, causal, has_seqlens, nq, nk, precision = key[:8]
    # Written only when there is something, so that the keys of plain calls keep their stored winners.
    modifiers = key_modifiers(key)
    return (
        f"{variant} BLOCK_D={block_d} {str(dtype).removeprefix('torch.')} causal={causal} seqlens={has_seqlens} "
        f"Nq<={nq} Nk<={nk} dot={precision}" + (f" {modifiers}" if modifiers else "")
    )


# -- heuristic -------------------------------------------------------------------------------------------------------
# Without a stored winner, the first config of these lists that is among the call's candidates (fits the shared
# memory, in the scope of Gluon/TMA) runs, else the first candidate.  Read off the H100 grids (bench/results/
# h100_bench_{fp16,bf16}.log, mean time over the fastest across N = 1k..16k, causal or not): each list is the winner
# of most keys, then the best config without Gluon, then without TMA, so that GPUs without them get a measured pick.
# Keyed by (kernel, head-dim tile <= 64); a 128 tile takes the False entry, a 256 tile WIDE_HEURISTIC_ORDER.
HEURISTIC_ORDER: dict[tuple[str, bool], tuple[str, ...]] = {
    ("forward", True): ("64x128 w4 s2 gluon", "128x64 w8 s3 tma", "128x64 w8 s3", "64x64 w4 s3"),
    ("forward", False): ("128x128 w8 s2 gluon", "128x128 w8 s3", "64x64 w4 s3"),
    # D <= 64 (the keys without a stored winner: score modifiers, GPUs without a shipped table): at the 20 dense keys
    # of bench/results/h100_dkdv_tuning_ws.log the 128-row Gluon tile took 1.00-1.08x the winner's time, the 64-row
    # one 1.00-1.22x, the Triton 64x64 w4 s3 1.04-1.24x; with ALiBi or a window the 128-row tile ran the whole
    # backward 1.13-1.22x faster than the Triton tile (h100_dkdv_d64_heuristic_ab.log).  With the soft cap it spills
    # (ptxas: 268-288 B) and took 1.24-1.43x the Triton tile's time, where the 64-row one ran 1.005-1.025x faster
    # than it: SOFTCAP_HEURISTIC_SKIPS.
    ("dkdv", True): ("128x64 w4 s2 gluon", "64x64 w4 s2 gluon", "64x64 w4 s3", "32x128 w4 s3"),
    ("dkdv", False): ("64x64 w4 s2 gluon", "32x64 w4 s3"),
    ("dq", True): ("64x64 w4 s3 tma", "64x64 w4 s3"),
    # The Gluon dQ kernel's 128-row tile won all 24 D = 128 keys of its tuning (bench/results/h100_dq_tuning.log).
    ("dq", False): ("128x64 w8 s3 gluon", "128x64 w8 s3 tma", "128x64 w8 s3"),
    # The atomic kernel: the Gluon five-product configs won every dense key of the grids, the warp-specialised
    # 128-key block at D = 128 and, since it is warp-specialised there too, at D = 64 (1.02-1.17x the 64-key block,
    # bench/results/h100_five_product_ws_d64_ab.log); without Gluon, the Triton kernel's winner of
    # bench/results/h100_atomic_tuning.log.
    ("atomic", True): ("64x128 w8 s2 gluon", "64x64 w4 s2 gluon", "128x64 w8 s2"),
    ("atomic", False): ("64x128 w8 s2 gluon", "128x64 w8 s2"),
}


# Tiles of 256 columns (D = 192 and 256).  The lists are timed at D = 192, Dv = 128 (bf16, N = 8k, full and causal,
# bench/results/h100_d192_tuning.log): the Gluon forward (its 128 x 64 tile where 128 x 128 does not fit, D = 256: the
# tuner's pick at every D = 256 key, bench/results/h100_d256_fwd_ws.log); dQ 64x64 w4 s3 with TMA (the next,
# 128x32 w8 s3, took 1.7-2.0x its time); dK/dV 32x128 w8 s3 (within 3% of the best in both masks; 64x32 w8 s2, the tile
# without spills, took 1.9-2.3x).  ptxas counts spills in most of these tiles (bench/ptx_report.py), but its counts
# ranked them wrongly.  Where Dv = 256 too, the shared memory drops the first entries; the later ones are ptxas's
# ranking (fewest spill bytes), not timed.  At D = Dv = 256 the Gluon dQ and dK/dV kernels that split the head dim
# between two warpgroups (backward_gluon_wide.py) won every key of their tuning, the Triton tiles taking 1.63-1.98x
# (dQ) and 2.56-3.14x (dK/dV) their time (bench/results/h100_d256_wide_{bf16,fp16}.log); at D = 192 with Dv = 128
# they ran the backward 1.40-1.82x faster than the Triton entries below (bench/results/h100_d192_wide_bwd.csv), and
# are the untimed pick there.  At both pairs they are the untimed pick with any score modifier too (no key of the
# shipped table has one) and on packed batches; elsewhere (D = Dv = 192) the Triton entries serve.
WIDE_HEURISTIC_ORDER: dict[str, tuple[str, ...]] = {
    "forward": ("128x128 w8 s2 gluon", "128x64 w8 s2 gluon", "128x64 w8 s3 tma", "64x32 w4 s2"),
    "dkdv": ("64x64 w4 s2 gluon", "32x128 w8 s3", "64x32 w8 s2"),
    "dq": ("64x64 w4 s2 gluon", "64x64 w4 s3 tma", "128x32 w8 s3", "64x32 w4 s2"),
    "atomic": ("128x32 w8 s2",),
}


# Configs the heuristic passes over for soft-capped calls: the soft cap's tanh and its derivative push them past 255
# registers into spills.
SOFTCAP_HEURISTIC_SKIPS: dict[str, tuple[str, ...]] = {"dkdv": ("128x64 w4 s2 gluon",)}

# Head-dim tile 128 under a window of at most NARROW_WINDOW_SPAN keys (the tuning key's ``window<=`` bucket): a
# 128-row block's band then covers three key tiles of 128, two of them cut by its edges, and the 64-row Gluon tiles
# come first.  Tuned at w = 256 (bench/results/h100_window_tuning.log, fp16/bf16, N 4k-16k, causal), the 128x128
# forward tile took 1.20-1.22x the 64x64 one's time and the 128x64 dQ tile 1.08-1.11x.
NARROW_WINDOW_SPAN = 256
NARROW_WINDOW_FIRST: dict[str, str] = {"forward": "64x64 w4 s2 gluon", "dq": "64x64 w4 s2 gluon"}
# Above that and up to MEDIUM_WINDOW_SPAN keys a 128-row block's band covers a few more key tiles (9 at w = 1024),
# still few enough for its prologue and epilogue to weigh, and the persistent forward comes first: it loads the next
# block's Q rows and first K/V tile while this block runs.  Tuned at w = 1024 (fp16/bf16, N 4k-16k, causal), it won
# all 6 forward keys, the 128x128 tile without persistence taking 1.11-1.14x its time on the H100
# (bench/results/h100_window_tuning_q_slots.log) and 1.08-1.13x on an H200 (h200_window_tuning_q_slots.log), and
# at w = 512 (bf16, 16k) 1.13x, the 64x64 tile 1.06x (h100_window_tuning_512_2048.log); at w = 4096 the tile
# without persistence won (h100_window_tuning.log, h200_window_tuning_q_slots.log), and at 2048 it ran within 5% of
# the persistent one.
MEDIUM_WINDOW_SPAN = 1024
MEDIUM_WINDOW_FIRST: dict[str, str] = {"forward": "128x128 w8 s2 gluon persistent"}


def window_span(modifiers: str) -> int | None:
    """The span bucket of a tuning key's window (``launch.ScoreModifiers.key``: ``window<=1024`` -> 1024), or None."""
    for word in modifiers.split():
        if word.startswith("window<="):
            return int(word[len("window<=") :])
    return None


def heuristic_pick(
    variant: str, block_d: int, configs: list[KernelConfig], softcap: bool = False, span: int | None = None
) -> KernelConfig:
    """The untimed choice among ``configs`` (the call's fitting, in-scope candidates): see ``HEURISTIC_ORDER``.
    ``softcap``: the call has a soft cap (``SOFTCAP_HEURISTIC_SKIPS``); ``span``: its window's span bucket
    (``NARROW_WINDOW_FIRST``, ``MEDIUM_WINDOW_FIRST``)."""
    kernel = variant.split(":", 1)[0]
    order = WIDE_HEURISTIC_ORDER.get(kernel, ()) if block_d >= 256 else HEURISTIC_ORDER.get((kernel, block_d <= 64), ())
    if block_d == 128 and span is not None and span <= NARROW_WINDOW_SPAN and kernel in NARROW_WINDOW_FIRST:
        order = (NARROW_WINDOW_FIRST[kernel], *order)
    elif block_d == 128 and span is not None and span <= MEDIUM_WINDOW_SPAN and kernel in MEDIUM_WINDOW_FIRST:
        order = (MEDIUM_WINDOW_FIRST[kernel], *order)
    skips = SOFTCAP_HEURISTIC_SKIPS.get(kernel, ()) if softcap else ()
    for text in order:
        cfg = KernelConfig.parse(text)
        if cfg in configs and text not in skips:
            return cfg
    return configs[0]


# -- when to time ----------------------------------------------------------------------------------------------------
_forced_timing: bool | None = None  # set by autotuning(): True times every key afresh, False never times
_timed_kernels: frozenset[str] | None = None  # set by autotuning(kernels=...): the kernels it times (None: all)


def _timing_requested() -> bool:
    return autotune_requested() if _forced_timing is None else _forced_timing


def _times_kernel(variant: str) -> bool:
    """Whether timing applies to the kernel of tuning-key variant ``variant`` (``"dq"``, ``"atomic:ordered"``)."""
    return _timed_kernels is None or variant.split(":")[0] in _timed_kernels


@contextlib.contextmanager
def autotuning(enabled: bool = True, kernels: Iterable[str] | None = None) -> Iterator[None]:
    """Inside, calls time their kernels' candidates (``enabled``) and store the winners on disk, or never time.

    ``enabled=True`` ignores the disk cache and the shipped table: each key is timed once more in this process (what
    ``python -m attnzoo tune`` and the benchmark want); configs remembered untimed are forgotten on entry.
    ``kernels`` (names of ``CANDIDATES``, e.g. ``("dq",)``): only their keys are timed; the other kernels run their
    stored, shipped or heuristic configs, untimed.  ``enabled=False`` overrides ``ATTNZOO_AUTOTUNE=1``.
    """
    global _forced_timing, _timed_kernels
    previous = _forced_timing, _timed_kernels
    _timed_kernels = None if kernels is None else frozenset(kernels)
    if enabled:
        for key in [k for k, source in AUTOTUNER.sources.items() if source != "timed" and _times_kernel(k[0])]:
            AUTOTUNER.forget(key)
    _forced_timing = bool(enabled)
    try:
        yield
    finally:
        _forced_timing, _timed_kernels = previous


def tuned_report() -> dict[str, str]:
    """Every key timed in this process, in order: its text -> one line with the candidates fastest first, each as its
    time over the fastest's, then its screening timings on the same scale in brackets."""
    return {key_text(key): AUTOTUNER.describe(key) for key in AUTOTUNER.timings}


def chosen_configs() -> dict[str, tuple[str, str]]:
    """Every key chosen in this process: its text -> (config text, source: timed, disk, shipped or heuristic)."""
    return {key_text(key): (str(cfg), AUTOTUNER.sources.get(key, "?")) for key, cfg in AUTOTUNER.best.items()}


# -- stored winners --------------------------------------------------------------------------------------------------
class DeviceIdentity(NamedTuple):
    """What a stored winner is valid for besides its key."""

    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int]
    triton: str
    attnzoo: str


@functools.cache
def _device_identity(index: int | None) -> DeviceIdentity | None:
    """The identity of CUDA device ``index`` (cached: a query per call would cost host time); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    import triton

    from .. import __version__

    index = index or 0
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceIdentity(torch.cuda.get_device_name(index), (major, minor), triton.__version__, __version__)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def current_identity() -> DeviceIdentity | None:
    """The identity of the current CUDA device (None without CUDA): what a winner stored now is valid for."""
    return _device_identity(torch.cuda.current_device() if torch.cuda.is_available() else None)


def cache_file(identity: DeviceIdentity) -> Path:
    """The JSON of stored winners for one GPU model, capability, Triton version and attnzoo version."""
    major, minor = identity.capability
    name = f"{_slug(identity.name)}_sm{major}{minor}_triton-{_slug(identity.triton)}_attnzoo-{_slug(identity.attnzoo)}"
    return cache_dir() / f"tuning_{name}.json"


def _read_winners(path: Path) -> dict[str, str]:
    """The ``winners`` of a cache file ({} when absent); raises ValueError/OSError when it cannot be used."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    data = json.loads(text)
    winners = data.get("winners") if isinstance(data, dict) else None
    if not isinstance(winners, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in winners.items()):
        raise ValueError("no 'winners' object of key text -> config text")
    return dict(winners)


class WinnerStore:
    """The user's disk cache of tuned winners: read once per device identity, written atomically on each new winner
    (merged with what another process may have written meanwhile).  An unreadable file is ignored with one warning."""

    def __init__(self) -> None:
        self._winners: dict[DeviceIdentity, dict[str, str]] = {}

    def winners(self, identity: DeviceIdentity) -> dict[str, str]:
        winners = self._winners.get(identity)
        if winners is None:
            path = cache_file(identity)
            try:
                winners = _read_winners(path)
            except (OSError, ValueError) as error:
                warnings.warn(f"attnzoo: ignoring the unreadable tuning cache {path} ({error})", stacklevel=2)
                winners = {}
            self._winners[identity] = winners
        return winners

    def save(self, identity: DeviceIdentity, text: str, cfg: KernelConfig) -> None:
        winners = self.winners(identity)
        winners[text] = str(cfg)
        path = cache_file(identity)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                on_disk = _read_winners(path)
            except (OSError, ValueError):
                on_disk = {}  # corrupt: replaced by what this process knows
            merged = {**on_disk, **winners}
            winners.update(merged)
            data = {
                "gpu": identity.name,
                "capability": list(identity.capability),
                "triton": identity.triton,
                "attnzoo": identity.attnzoo,
                "winners": dict(sorted(merged.items())),
            }
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(data, fh, indent=1)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as error:
            warnings.warn(f"attnzoo: could not write the tuning cache {path} ({error})", stacklevel=2)


@functools.cache
def _shipped_tables() -> tuple[tuple[str, Mapping[str, str]], ...]:
    """(GPU name, winners) of every JSON in ``attnzoo/tuning_data`` (read once)."""
    tables = []
    for entry in resources.files("attnzoo").joinpath("tuning_data").iterdir():
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text())
            tables.append((data["gpu"], data["winners"]))
    return tuple(tables)


def shipped_winners(identity: DeviceIdentity) -> Mapping[str, str]:
    """The shipped winners measured on the running GPU's model ({} for other models)."""
    for gpu, winners in _shipped_tables():
        if gpu == identity.name:
            return winners
    return {}


def _known_config(text: str | None, configs: list[KernelConfig]) -> KernelConfig | None:
    """The stored config ``text`` if it is still a candidate of this call (candidates change between versions)."""
    if text is None:
        return None
    try:
        cfg = KernelConfig.parse(text)
    except ValueError:
        return None
    return cfg if cfg in configs else None


def winners_from_bench_log(lines: Iterable[str]) -> dict[str, str]:
    """Key text -> winner of each ``[tuned]`` line of an ``attnzoo bench`` log (candidates listed fastest first).

    Lines written before the key carried the dot precision get ``dot=ieee``, what fp16/bf16 use (float32 lines of
    that age are skipped: their precision is unknown).
    """
    winners = {}
    for line in lines:
        if "[tuned] " not in line:
            continue
        head, ranked = line.split("[tuned] ", 1)[1].split(": ", 1)
        if " dot=" not in head:
            if " float32 " in head:
                continue
            head += " dot=ieee"
        # "64x128 w4 s2 gluon 1.00 [1.05 1.06]": the config, its time over the fastest, its screening times
        winners[head] = re.sub(r" [\d.]+(?: \[[^]]*\])?$", "", ranked.split(", ", 1)[0].strip())
    return winners


def write_shipped_table(logs: Iterable[str | Path], gpu: str, out: str | Path) -> dict[str, str]:
    """Build a shipped table (``attnzoo/tuning_data/*.json``) from ``attnzoo bench`` logs measured on ``gpu``."""
    winners: dict[str, str] = {}
    sources = []
    for log in logs:
        path = Path(log)
        winners.update(winners_from_bench_log(path.read_text().splitlines()))
        sources.append(path.name)
    for text in winners.values():
        KernelConfig.parse(text)  # every winner must read back
    data = {"gpu": gpu, "source": ", ".join(sources), "winners": dict(sorted(winners.items()))}
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return winners


AUTOTUNER = Autotuner()
