"""What every kernel launch of one attention call needs: the inputs, the mask parameters, the dot precision,
the output allocation, the debug counters and the choice of launch config.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from triton.runtime.errors import OutOfResources

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: every launch uses pointer loads
    TensorDescriptor = None

from ..backend import new_output, triton_interpreter_active
from .gluon_hopper import HOPPER_DTYPES, HOPPER_HEAD_DIMS, gluon_unavailable_reason
from .tuning import AUTOTUNER, CANDIDATES, INTERPRETER_CONFIG, KernelConfig, candidates, head_dim_tile, seqlen_bucket

# The longest tile side of any launch config: in-tile offsets (row * row stride + col * col stride) are int32.
_MAX_TILE_ROWS = max(max(c.block_m, c.block_n) for configs in CANDIDATES.values() for c in configs)
_INT32_MAX = 2**31 - 1

_placeholders: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A small int32 buffer passed for pointer arguments a launch never reads or writes (cached per device:
    a fresh allocation per call would cost a fill kernel and host time)."""
    buf = _placeholders.get(device)
    if buf is None:
        buf = _placeholders[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return buf


def int32_addressable(x: torch.Tensor, max_head_dim: int = 256) -> torch.Tensor:
    """``x`` itself, or a contiguous copy when one tile's element offsets could overflow int32.

    The kernels add batch/head/row-start offsets to the base pointer in int64 but index inside a tile in int32
    (``row * stride_row + col * stride_col``): a view whose sequence stride is huge (e.g. ``[N, B, H, D]``
    memory with B*H*D above ~2^24) would wrap there.  Contiguous rows have stride D, far from it.
    """
    stride_row, stride_col = (abs(s) for s in x.stride()[-2:])
    if _MAX_TILE_ROWS * stride_row + max_head_dim * stride_col <= _INT32_MAX:
        return x
    return x.contiguous()


@functools.cache
def _compute_capability_major(index: int) -> int:
    """The major compute capability of CUDA device ``index`` (cached: torch's query costs host time per call)."""
    return torch.cuda.get_device_capability(index)[0]


def descriptor_loads_possible(x: torch.Tensor) -> bool:
    """Whether tiles of ``x`` ``[B, H, N, D]`` can be loaded through a TMA tensor descriptor.

    The copy engine needs a Hopper-or-newer NVIDIA GPU (or the interpreter, which emulates it), a non-empty tensor, a
    contiguous last dimension, and a 16-byte aligned base address and outer strides (positive: broadcast views keep
    pointers).
    """
    if TensorDescriptor is None or x.numel() == 0:  # a descriptor needs every dimension positive (Nk = 0 is legal)
        return False
    on_hopper = x.is_cuda and torch.version.hip is None and _compute_capability_major(x.device.index or 0) >= 9
    if not triton_interpreter_active() and not on_hopper:
        return False
    itemsize = x.element_size()
    outer_strides_ok = all(stride > 0 and stride * itemsize % 16 == 0 for stride in x.stride()[:-1])
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and outer_strides_ok


def tile_descriptor(x: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor:
    """A descriptor of ``x`` ``[B, H, N, D]`` whose box is one ``[block_rows, block_d]`` tile of one (batch, head).

    Being 4-d (not a flat ``[B*H*N, D]`` view), it ends each head at its N rows and D columns: a box reaching past
    them reads zeros, never the next head.
    """
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block_rows, block_d])


def num_blocks(n: int, block: int) -> int:
    """How many tiles of ``block`` rows cover ``n`` rows (integer arithmetic: ``triton.cdiv`` costs host time)."""
    return -(-n // block)


def _launched(cfg: KernelConfig, launch: Callable[[KernelConfig], None], reset: Callable[[], None] | None) -> bool:
    """Launch ``cfg`` after ``reset``; False if it does not fit the device (out of shared memory or registers)."""
    try:
        if reset is not None:
            reset()
        launch(cfg)
    except OutOfResources:
        return False
    return True


def grid_1d(programs: int) -> tuple[int]:
    """A 1-d grid: programs are laid out flat so that B*H may exceed the 65535 limit of grid axes 1 and 2."""
    return (programs,)


def folds_scale(scale: float, block_d: int) -> bool:
    """Whether the forward folds the softmax scale into exp2's argument (one FFMA per score instead of FMUL + FADD).

    Only where the softmax's instructions rival the matrix products: head-dim tiles up to 64.  At 128 the products
    dominate, and on the H100 the fold cost 5-9% in the causal forward (more registers: ptxas spills 48 B at
    128 x 128; docs/design.md).  Never for a scale <= 0 (the kernel's FOLD_SCALE path needs it positive).
    """
    return scale > 0 and block_d <= 64


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full IEEE float32 unless PyTorch allows TF32 matmuls (ignored for fp16/bf16)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not triton_interpreter_active():
        return "tf32"
    return "ieee"


@dataclass
class LaunchContext:
    """One attention call, prepared for the kernels.

    q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` (any strides, passed to the kernels as they are).
    ``forced_config``: use this config (or ``{kernel: config}``, e.g. ``{"dkdv": ...}``) instead of the
    autotuner's choice (debug mode, tests of every candidate).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool
    seqlens_k: torch.Tensor | None
    debug: bool = False
    forced_config: KernelConfig | dict[str, KernelConfig] | None = None
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    configs: dict[str, KernelConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.q, self.k, self.v = (int32_addressable(x) for x in (self.q, self.k, self.v))
        device = self.q.device
        self.group_size = self.q.shape[1] // self.k.shape[1]
        self.seqlen_k = self.k.shape[2]
        self.block_d = head_dim_tile(self.q.shape[3])
        self.even_d = self.q.shape[3] == self.block_d  # no column mask needed
        self.dot_precision = dot_precision(self.q.dtype)
        self.fold_scale = folds_scale(self.scale, self.block_d)
        self.has_seqlens = self.seqlens_k is not None
        if self.has_seqlens:
            self.seqlens = self.seqlens_k.to(device=device, dtype=torch.int32).contiguous()
        else:
            self.seqlens = _placeholder(device)  # never read
        self._dummy_counts = _placeholder(device)  # never written
        self._running: str | None = None

    @cached_property
    def kv_descriptors(self) -> bool:
        """Whether K and V can be loaded through TMA descriptors (by the forward and the dQ kernel)."""
        return descriptor_loads_possible(self.k) and descriptor_loads_possible(self.v)

    def kv_tile_descriptors(self, cfg: KernelConfig) -> tuple[bool, object, object]:
        """``(USE_TMA, k_desc, v_desc)`` of a launch that streams K/V tiles of ``cfg.block_n`` keys: descriptors of
        ``[block_n, BLOCK_D]`` boxes when ``cfg`` asks for TMA and the inputs allow it, else False and the K/V
        tensors themselves (a placeholder the kernel never reads)."""
        if cfg.tma and self.kv_descriptors:
            return True, *(tile_descriptor(x, cfg.block_n, self.block_d) for x in (self.k, self.v))
        return False, self.k, self.v

    def hopper_reasons(self, kernel: str = "forward", do: torch.Tensor | None = None) -> list[str]:
        """Why a ``gluon`` config of ``kernel`` runs its Triton twin on this call; [] when the Gluon kernel can run.

        ``kernel``: ``"forward"`` (``forward_gluon.py``) or ``"dkdv"`` (``backward_gluon.py``, which also loads the
        output gradient ``do`` by TMA).
        """
        q = self.q
        unavailable = gluon_unavailable_reason()
        if unavailable:
            return [unavailable]
        if triton_interpreter_active() or not q.is_cuda or torch.version.hip is not None:
            return ["Gluon's Hopper kernels run on an NVIDIA GPU only (not in the interpreter, not on ROCm)"]
        reasons = []
        if _compute_capability_major(q.device.index or 0) != 9:
            reasons.append("wgmma needs an sm_90 (Hopper) GPU")
        if q.dtype not in HOPPER_DTYPES:
            reasons.append(f"dtype {q.dtype}: float16 and bfloat16 only")
        if q.shape[-1] not in HOPPER_HEAD_DIMS:
            reasons.append(f"head dim {q.shape[-1]}: {' and '.join(map(str, HOPPER_HEAD_DIMS))} only")
        if self.has_seqlens:
            # TMA zero-fills past Nk only: K/V rows past seqlens_k[b] arrive as they are, and a NaN there makes P V
            # (forward) or dP (backward) NaN even where P = 0.
            reasons.append("seqlens_k: the K/V rows past seqlens_k[b] may hold anything, and TMA cannot zero them")
        if kernel == "forward" and not self.scale > 0:
            reasons.append("scale <= 0: the kernel folds a positive scale into exp2's argument")
        if self.debug:
            reasons.append("debug mode: the Gluon kernels keep no tile counts")
        if kernel == "dkdv" and (do is None or not descriptor_loads_possible(do)):
            reasons.append("do not addressable by TMA (empty, or not: last stride 1, 16-byte aligned strides)")
        if not (descriptor_loads_possible(q) and self.kv_descriptors):
            reasons.append("q, k or v not addressable by TMA (empty, or not: last stride 1, 16-byte aligned strides)")
        return reasons

    @cached_property
    def hopper_forward(self) -> bool:
        """Whether a ``gluon`` forward config runs the Gluon Hopper kernel here (else its Triton twin)."""
        return not self.hopper_reasons("forward")

    def mask_stage_needed(self, block_n: int) -> bool:
        """Whether some tile of ``block_n`` keys needs the visibility mask: a causal diagonal, ``seqlens_k``, or a
        last K/V tile cut by Nk.  When none does, the kernels leave their masked loop out at compile time: the
        loop would run no iteration, but its code alone costs registers in kernels that sit at the limit."""
        return self.causal or self.has_seqlens or self.seqlen_k % block_n != 0

    def new_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous output buffer that the kernels write completely (NaN-filled under ATTNZOO_POISON_OUTPUTS=1)."""
        return new_output(shape, dtype, self.q.device)

    def counts_for(self, programs: int) -> torch.Tensor:
        """The debug counter buffer (``programs`` x (visited, skipped) int32) of the kernel being launched."""
        if not self.debug:
            return self._dummy_counts
        buf = torch.full((programs, 2), -1, dtype=torch.int32, device=self.q.device)
        self.counts[self._running] = buf
        return buf

    def run(
        self,
        kernel: str,
        launch: Callable[[KernelConfig], None],
        reset: Callable[[], None] | None = None,
        gluon_in_scope: bool = False,
    ) -> KernelConfig:
        """Launch ``kernel`` with the interpreter's, the forced or the autotuned config; returns the config used.

        ``kernel`` names the candidate list (``"forward"``, ``"dkdv"``, ``"dq"``, ``"atomic"``), optionally
        followed by ``":variant"`` when variants of one kernel must be tuned apart.

        ``reset`` zeroes accumulation buffers; it runs before every launch of the kernel, so tuning trials
        never leave partial sums behind.  ``gluon_in_scope``: ``launch`` runs the Gluon kernel for a ``gluon``
        config (``hopper_reasons``); otherwise such a config would run its Triton twin, and the tuner skips it.
        """
        self._running = kernel
        forced = self.forced_config
        if isinstance(forced, dict):
            forced = forced.get(kernel.split(":")[0])
        if forced is not None or triton_interpreter_active():
            cfg = forced if forced is not None else INTERPRETER_CONFIG
            if reset is not None:
                reset()
            launch(cfg)
        else:
            cfg = self._tune_and_launch(kernel, launch, reset, gluon_in_scope)
        self.configs[kernel] = cfg
        self._running = None
        return cfg

    def _tune_and_launch(
        self,
        kernel: str,
        launch: Callable[[KernelConfig], None],
        reset: Callable[[], None] | None,
        gluon_in_scope: bool,
    ) -> KernelConfig:
        """Launch with the autotuner's choice for this call's key; returns the config that ran."""
        q = self.q
        key = (
            kernel,
            self.block_d,
            q.dtype,
            self.causal,
            self.has_seqlens,
            seqlen_bucket(q.shape[2]),
            seqlen_bucket(self.seqlen_k),
            self.dot_precision,
            q.device.index,
        )
        cfg = AUTOTUNER.best.get(key)
        if cfg is not None:  # tuned by an earlier call, and launched then: the common case, kept short
            if _launched(cfg, launch, reset):
                return cfg
            del AUTOTUNER.best[key]  # another specialisation of this key (say, another head dim) needs more
        configs = candidates(kernel.split(":")[0], self.block_d, q.dtype, q.device)
        # Configs that would launch as a twin of another candidate here are not timed twice: TMA ones without
        # descriptors (their pointer twin), Gluon ones outside its scope (the Triton kernel with the same tiles).
        if any(c.tma for c in configs) and not self.kv_descriptors:
            configs = [c for c in configs if not c.tma] or configs
        if any(c.gluon for c in configs) and not gluon_in_scope:
            configs = [c for c in configs if not c.gluon] or configs
        cfg = AUTOTUNER.choose(key, configs, launch, reset)
        # The shared-memory estimate is rough: if the chosen config does not fit after all, take the next.
        for fallback in [cfg] + [c for c in configs if c != cfg]:
            if _launched(fallback, launch, reset):
                AUTOTUNER.best[key] = fallback
                return fallback
        del AUTOTUNER.best[key]
        raise RuntimeError(f"no launch configuration of {kernel} fits this device; tried {configs}")
