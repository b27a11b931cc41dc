"""The launch layer: from a validated call to kernel launches.

- :func:`prepare` turns a call (``q``, ``k``, ``v`` and the :class:`~attnzoo.validation.Problem` that carries every
  other argument) into a :class:`PreparedCall`: the tensors as the kernels address them, the mask and precision
  parameters, the forced configs and the debug counters, all fixed once.
- :class:`KernelVariant` names what runs (``forward``, ``dq``, ``dkdv``, the atomic backward with either Delta); a
  variant with a Gluon Hopper kernel declares where it can run in its :class:`GluonScope`.
- :func:`run` launches one variant with the config it gets: forced, the interpreter's, or the tuner's
  (:func:`attnzoo.kernels.tuning.launch_with_best`).

The kernel modules (``forward.py``, ``backward_2kernel.py``, ``backward_atomic.py``) build the launch closures.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: every launch uses pointer loads
    TensorDescriptor = None

from .._env import new_output, triton_interpreter_active
from ..validation import Problem
from . import tuning
from .common import LOG2E
from .gluon_hopper import HOPPER_DTYPES, gluon_unavailable_reason
from .tuning import CANDIDATES, INTERPRETER_CONFIG, KernelConfig, head_dim_tile, seqlen_bucket

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
    # A packed [total, H, D] tensor (varlen) steps rows by its first stride.
    stride_row, stride_col = (abs(s) for s in (x.stride(0 if x.dim() == 3 else -2), x.stride(-1)))
    if _MAX_TILE_ROWS * stride_row + max_head_dim * stride_col <= _INT32_MAX:
        return x
    return x.contiguous()


@functools.cache
def _compute_capability_major(index: int) -> int:
    """The major compute capability of CUDA device ``index`` (cached: torch's query costs host time per call)."""
    return torch.cuda.get_device_capability(index)[0]


def rows_16_aligned(x: torch.Tensor) -> bool:
    """Whether Triton's specialisation sees the rows of ``x`` 16-element aligned: a 16-byte aligned base address and
    every stride but the last a multiple of 16 (the integer divisibility that Triton specialises on)."""
    return x.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in x.stride()[:-1])


def _masked_columns_narrow_v(head_dim: int, block_d: int, block_dv: int) -> bool:
    """The case Triton 3.6 compiled wrong for v's rows that are not 16-element aligned (``value_tile_width``): q/k's
    columns masked (D below its tile) and v's tile narrower than q/k's."""
    return head_dim != block_d and block_dv < block_d


def value_tile_width(head_dim: int, head_dim_v: int, block_d: int, v: torch.Tensor) -> int:
    """The Triton kernels' tile width of v, o and do (``BLOCK_DV``): Dv's power of two, or ``block_d`` where a narrower
    tile would be compiled wrong.

    On the H100 with Triton 3.6 the compiled kernels gave wrong outputs (or an illegal memory access) when q/k's
    columns are masked (D not a power of two, e.g. 40 in a 64-column tile), the v tile is narrower than q/k's (Dv =
    8, 16 or 32 there), and v's rows are not 16-element aligned (row strides of 8, 24 or 40, or a base address 6
    bytes past alignment); the interpreter's outputs were right, and every such case passed with the v tile as wide
    as q/k's (docs/design.md, "Score modifiers in the kernels").  So the narrower tile is kept only where Dv is a
    multiple of 16 and v's rows are aligned (D = 192 with Dv = 128 keeps its 128-column tile); the backward copies
    a misaligned ``do`` or ``o`` of such a call (``aligned_value_rows``).
    """
    block_dv = head_dim_tile(head_dim_v)
    if _masked_columns_narrow_v(head_dim, block_d, block_dv) and (head_dim_v % 16 != 0 or not rows_16_aligned(v)):
        block_dv = block_d
    return block_dv


def aligned_value_rows(x: torch.Tensor, call: PreparedCall) -> torch.Tensor:
    """``do`` or ``o`` for the backward kernels: a contiguous copy where the call keeps a v tile narrower than q/k's
    with D not a power of two (``value_tile_width``) and the rows of ``x`` are not 16-element aligned, else ``x``
    (``int32_addressable``)."""
    if _masked_columns_narrow_v(call.problem.head_dim, call.block_d, call.block_dv) and not rows_16_aligned(x):
        return x.clone(memory_format=torch.contiguous_format)
    return int32_addressable(x)


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


def tensor_args(x: torch.Tensor) -> tuple:
    """A ``[B, H, N, D]`` tensor as the kernels take it: the tensor (its pointer), then its four strides.

    A packed ``[total, H, D]`` tensor (varlen) passes its row stride as the batch stride too: the kernels then index
    its "batch" by a sequence's first row (``common.q_block_opening``) and its rows from there."""
    if x.dim() == 3:
        return (x, x.stride(0), x.stride(1), x.stride(0), x.stride(2))
    return (x, *x.stride())


def num_blocks(n: int, block: int) -> int:
    """How many tiles of ``block`` rows cover ``n`` rows (integer arithmetic: ``triton.cdiv`` costs host time)."""
    return -(-n // block)


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


class KernelVariant(enum.Enum):
    """What one launch runs; its value is the tuning key's first field (tuned apart from the other variants)."""

    FORWARD = "forward"
    DQ = "dq"  # the Q-stationary dQ kernel, which also writes Delta and lse in base 2
    DKDV = "dkdv"  # the K/V-stationary dK/dV kernel
    # The atomic backward with Delta from the preprocess kernel: the Q-stationary Triton kernel (atomic dK/dV) or, for
    # its gluon configs on Hopper, the five-product Gluon kernel (atomic dQ).
    ATOMIC_PREPROCESS = "atomic:preprocess"
    ATOMIC_RECOMPUTE = "atomic:recompute"  # the same with Delta recomputed by a first pass over K/V
    # The atomic backward's Hopper path with its dQ shares added in a fixed order (its Gluon configs only).
    ATOMIC_ORDERED = "atomic:ordered"

    @property
    def kernel(self) -> str:
        """The kernel whose candidate configs the variant uses, and its name in ``configs={...}`` of a backend."""
        return _KERNEL_OF[self]

    @property
    def gluon_scope(self) -> GluonScope | None:
        """Where the variant's ``gluon`` configs run a Gluon Hopper kernel (None: the variant has none)."""
        return _GLUON_SCOPES.get(self)


_KERNEL_OF = {
    KernelVariant.FORWARD: "forward",
    KernelVariant.DQ: "dq",
    KernelVariant.DKDV: "dkdv",
    KernelVariant.ATOMIC_PREPROCESS: "atomic",
    KernelVariant.ATOMIC_RECOMPUTE: "atomic",
    KernelVariant.ATOMIC_ORDERED: "atomic",
}


@dataclass(frozen=True)
class ScoreModifiers:
    """SPEC.md's score modifiers and the value head dim as every Triton kernel takes them: ``args`` go after the
    kernel's ``head_dim`` (``head_dim_v, window_left, window_right, cap_in, cap_out, alibi_ptr, stride_alibi_b,
    stride_alibi_h``) and ``flags`` are its constexprs (``BLOCK_DV``, ``EVEN_DV``, ``DV_IS_D``, ``WINDOW_LEFT``,
    ``WINDOW_RIGHT``, ``SOFTCAP``, ``ALIBI``).  A call without any of them sets every flag off (``DV_IS_D`` on), so
    the kernels compile exactly as without these arguments.

    The window becomes the band ``-left <= j - i' <= right``: causal caps the right side at 0, and a right bound that
    causal already implies (``right >= 0``) is dropped, so causal with ``window=(w, 0)`` adds only the left bound.
    A side that hides no key (``left >= Nk - 1``, ``right >= Nq - 1``) is dropped too.  Sides are clamped to
    ``[-(Nq + Nk), Nq + Nk]``, which changes no mask and keeps the kernels' int32 sums exact.
    The soft cap ``c`` reaches the kernels as ``cap_in = 1 / (c * log2(e))`` and ``cap_out = c * log2(e)``, and SOFTCAP
    is 2 (hardware tanh, float16/bfloat16 on a GPU) or 1 (float32-exact tanh) (``common.softcap_scores``).
    ``alibi``: the slopes as float32 ``[B, H]`` (a stride-0 view for ``[H]``).
    """

    args: tuple
    flags: dict
    window_left_bounded: bool
    window_right_bounded: bool
    softcap: bool
    alibi: bool
    key: str  # what the tuning key adds ("" without modifiers: dense keys keep their stored winners; a band's span)

    @property
    def cap_out(self) -> float:
        """The soft cap as the kernels take it, ``c * log2(e)`` (0.0 without one): ``args[4]``."""
        return self.args[4]

    @classmethod
    def of(
        cls, problem: Problem, device: torch.device, block_d: int, block_dv: int, bound: int | None = None
    ) -> ScoreModifiers:
        # ``bound``: where window sides are clamped (a packed call passes total_q + total_k: its seqlen_q/seqlen_k
        # are only hints of the longest sequence).
        bound = problem.seqlen_q + problem.seqlen_k if bound is None else bound
        left, right = problem.window if problem.window is not None else (None, None)
        if problem.causal and right is not None:
            right = min(right, 0)
            if right == 0:
                right = None  # causal's own bound
        # The diagonals j - i' of the score matrix run from -(Nk - 1) to Nq - 1 (with seqlens_k too), so a side at or
        # past the last one hides no key: it is dropped, and such a window runs (and is tuned) as the call without it.
        left_bounded = left is not None and left < problem.seqlen_k - 1
        right_bounded = right is not None and right < problem.seqlen_q - 1
        window_left = max(-bound, min(bound, left)) if left_bounded else 0
        window_right = max(-bound, min(bound, right)) if right_bounded else 0
        softcap = problem.softcap
        if softcap:
            cap_in, cap_out = 1.0 / (softcap * LOG2E), softcap * LOG2E
            # 2: the hardware tanh (float16/bfloat16 on a GPU); 1: the float32-exact one (common.softcap_scores).
            approx = problem.dtype in (torch.float16, torch.bfloat16) and not triton_interpreter_active()
            softcap_mode = 2 if approx else 1
        else:
            cap_in = cap_out = 0.0
            softcap_mode = 0
        slopes = problem.alibi_slopes
        if slopes is not None:
            slopes = torch.as_tensor(slopes).to(device=device, dtype=torch.float32)
            slopes = slopes.expand(problem.batch, problem.heads) if slopes.dim() == 1 else slopes
            alibi_args = (slopes, *slopes.stride())
        else:
            alibi_args = (_placeholder(device), 0, 0)
        dv = problem.head_dim_v
        flags = dict(
            BLOCK_DV=block_dv, EVEN_DV=dv == block_dv, DV_IS_D=dv == problem.head_dim, WINDOW_LEFT=left_bounded,
            WINDOW_RIGHT=right_bounded, SOFTCAP=softcap_mode, ALIBI=slopes is not None,
        )  # fmt: skip
        window_key = ""
        if left_bounded or right_bounded:
            # The band's span (keys a row may see, less one) sets the K/V tiles per Q block, and with them the best
            # tiles: three for a 128-row block under a 256-key window, thirty-three under a 4096-key one.  Tuned
            # winners are kept per power-of-two bucket of it, as per bucket of N; an unbounded side reaches the last
            # diagonal (a bounded one stops before it, above).
            left_reach = window_left if left_bounded else problem.seqlen_k - 1
            right_reach = window_right if right_bounded else (0 if problem.causal else problem.seqlen_q - 1)
            window_key = f"window<={seqlen_bucket(max(left_reach + right_reach, 1))}"
        parts = [
            window_key,
            "softcap" if softcap else "",
            "alibi" if slopes is not None else "",
            f"BLOCK_DV={block_dv}" if block_dv != block_d else "",
            "varlen" if problem.is_varlen else "",
        ]
        return cls(
            args=(dv, window_left, window_right, cap_in, cap_out, *alibi_args),
            flags=flags,
            window_left_bounded=left_bounded,
            window_right_bounded=right_bounded,
            softcap=bool(softcap),
            alibi=slopes is not None,
            key=" ".join(p for p in parts if p),
        )


@dataclass(eq=False)
class PreparedCall:
    """One attention call, prepared for the kernels by :func:`prepare`; nothing in it changes afterwards (not frozen
    only because a frozen dataclass costs host time per call to build).

    q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` (any strides, passed to the kernels as they are, unless a tile's
    int32 offsets could wrap: ``int32_addressable``).  ``seqlens``: int32 ``[B]`` (a placeholder the kernels never
    read without ``seqlens_k``).  ``forced``: kernel name (``"forward"``, ``"dq"``, ``"dkdv"``, ``"atomic"``) ->
    the config always used for it.  ``counts``: the caller's dict that debug launches record their per-program
    ``(visited, skipped)`` tile counts in, per variant (None: no debug build).

    A packed variable-length call (``varlen``): q ``[total_q, H, D]``, k, v ``[total_k, Hkv, D]``; ``varlen_args``
    are the kernels' ``(cu_seqlens_q, cu_seqlens_k, B, search_steps)`` (placeholders and zeros for a dense call), and
    ``seqlen_q``/``seqlen_k`` are the kernels' arguments: Nq and Nk, or total_q and total_k.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    problem: Problem
    seqlens: torch.Tensor
    forced: Mapping[str, KernelConfig]
    counts: dict[KernelVariant, torch.Tensor] | None
    # Read per launch, so plain fields rather than properties over ``problem`` (host time counts).
    scale: float
    causal: bool
    has_seqlens: bool
    group_size: int
    seqlen_k: int
    block_d: int
    even_d: bool  # D == BLOCK_D: no column mask needed
    dot_precision: str
    fold_scale: bool
    debug: bool  # the kernels are built with their tile counters (DEBUG): counts is not None
    block_dv: int  # the head-dim tile of v, o, do and dv (BLOCK_D when Dv == D)
    # The kernels' runtime arguments and constexpr flags of the score modifiers and of Dv (``ScoreModifiers``).
    modifiers: ScoreModifiers
    seqlen_q: int = 0
    varlen: bool = False
    varlen_args: tuple = ()
    # FP8 inputs (``attnzoo.attention_fp8``): float32 ``[B, Hkv, 3]`` factors of q, k and v; o is bfloat16.
    descale: torch.Tensor | None = None
    # What launches decide from the call alone (Gluon scope reasons, tuning keys), remembered by ``gluon_reasons`` and
    # ``run``; one dict for every call prepared from the same template (``prepare``), which all decide alike.
    derived: dict = field(default_factory=dict)
    # The template's number (``prepare``): calls of one template specialise every kernel alike (``launch_key``);
    # None for a call prepared afresh.
    template_id: int | None = None

    def with_tensors(self, q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None) -> PreparedCall:
        """This call with other q, k, v of the same signature (``_signature``); the ``derived`` dict is shared."""
        call = object.__new__(PreparedCall)  # a shallow copy (copy.copy's __reduce_ex__ path takes 3x the host time)
        call.__dict__.update(self.__dict__)
        call.q, call.k, call.v = q, k, v
        call.__dict__.pop("kv_descriptors", None)  # a cached property: recomputed for the new tensors
        return call

    def launch_key(self, *operands: torch.Tensor) -> tuple | None:
        """The key under which a launch on this call reuses the kernel that Triton found for the first
        (``compiled_launch``): the template's number, which fixes q, k, v and every integer of the problem, and the
        dtype, strides and 16-byte alignment of ``operands``, the launch's tensors that are neither q, k, v nor
        outputs the launcher allocates.  None for a call without a template: Triton binds its every launch."""
        if self.template_id is None:
            return None
        return (self.template_id, *((x.dtype, x.stride(), x.data_ptr() % 16) for x in operands))

    @property
    def output_dtype(self) -> torch.dtype:
        """o's dtype: q's, or bfloat16 for FP8 inputs."""
        return self.q.dtype if self.descale is None else torch.bfloat16

    @property
    def descale_args(self) -> dict:
        """The forward kernel's FP8 arguments (none for other calls: the kernel's defaults)."""
        return {} if self.descale is None else {"descale_ptr": self.descale, "DESCALE": True}

    def q_slots(self, block_m: int) -> int:
        """Programs per (batch, head) of a Q-stationary grid: Q blocks; packed, per head: ``total_q // block_m + B``
        slots (``common.varlen_block``)."""
        if self.varlen:
            return self.seqlen_q // block_m + self.problem.batch
        return num_blocks(self.seqlen_q, block_m)

    def kv_slots(self, block_n: int) -> int:
        """Programs per (batch, K/V head) of the K/V-stationary grid (packed: per K/V head)."""
        if self.varlen:
            return self.seqlen_k // block_n + self.problem.batch
        return num_blocks(self.seqlen_k, block_n)

    def q_programs(self, block_m: int) -> int:
        """The programs of a Q-stationary grid of ``block_m`` rows."""
        return self.q_slots(block_m) * self.problem.heads * (1 if self.varlen else self.problem.batch)

    def kv_programs(self, block_n: int) -> int:
        """The programs of the K/V-stationary grid of ``block_n`` keys."""
        return self.kv_slots(block_n) * self.problem.kv_heads * (1 if self.varlen else self.problem.batch)

    @property
    def row_stats_shape(self) -> tuple[int, ...]:
        """Shape of a per-row statistic (lse, lse2, Delta): ``[B, H, Nq]``, packed ``[H, total_q]``."""
        if self.varlen:
            return (self.problem.heads, self.seqlen_q)
        return (self.problem.batch, self.problem.heads, self.seqlen_q)

    def output_shape(self, head_dim: int) -> tuple[int, ...]:
        """Shape of o (``head_dim`` Dv) or dq: q's rows and heads, packed or not."""
        return (*self.q.shape[:-1], head_dim)

    @cached_property
    def kv_descriptors(self) -> bool:
        """Whether K and V can be loaded through TMA descriptors (by the forward and the dQ kernel); never packed
        (a tile of one sequence is addressed by its first row, which the 4-d descriptors do not take)."""
        if self.varlen:
            return False
        return descriptor_loads_possible(self.k) and descriptor_loads_possible(self.v)

    def kv_tile_descriptors(self, cfg: KernelConfig) -> tuple[bool, object, object]:
        """``(USE_TMA, k_desc, v_desc)`` of a launch that streams K/V tiles of ``cfg.block_n`` keys: descriptors of
        ``[block_n, BLOCK_D]`` (k) and ``[block_n, BLOCK_DV]`` (v) boxes when ``cfg`` asks for TMA and the inputs
        allow it, else False and the K/V tensors themselves (a placeholder the kernel never reads)."""
        if cfg.tma and self.kv_descriptors:
            return (
                True,
                tile_descriptor(self.k, cfg.block_n, self.block_d),
                tile_descriptor(self.v, cfg.block_n, self.block_dv),
            )
        return False, self.k, self.v

    def mask_stage_needed(self, block_n: int) -> bool:
        """Whether some tile of ``block_n`` keys may need the mask on its right edge: a causal diagonal, a window's
        right bound, ``seqlens_k``, or a last K/V tile cut by Nk.  When none does, the kernels leave that masked loop
        out at compile time: the loop would run no iteration, but its code alone costs registers in kernels that sit
        at the limit.  (The window's left edge has its own stage, compiled with WINDOW_LEFT.)"""
        return (
            self.causal or self.has_seqlens or self.varlen or self.seqlen_k % block_n != 0
            or self.modifiers.window_right_bounded
        )  # fmt: skip

    def new_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous output buffer that the kernels write completely (NaN-filled under ATTNZOO_POISON_OUTPUTS=1)."""
        return new_output(shape, dtype, self.q.device)

    def counts_for(self, variant: KernelVariant, programs: int) -> torch.Tensor:
        """The tile-count buffer (``programs`` x (visited, skipped) int32) of a launch of ``variant``, recorded in
        ``counts``; without debug a placeholder that the kernel never writes."""
        if self.counts is None:
            return _placeholder(self.q.device)
        buf = torch.full((programs, 2), -1, dtype=torch.int32, device=self.q.device)
        self.counts[variant] = buf
        return buf

    def gluon_reasons(self, variant: KernelVariant, *extra_tma_operands: torch.Tensor) -> list[str]:
        """Why a ``gluon`` config of ``variant`` runs its Triton twin on this call; [] when the Gluon kernel runs.

        Remembered in ``derived``: the reasons depend on the call's signature, on whether a Gluon kernel failed to
        compile in this process (``gluon_unavailable_reason``), and of the extra operands (``do``, ``o``) only on
        whether TMA can address them."""
        available = gluon_unavailable_reason() is None
        key = (variant, available, *(descriptor_loads_possible(x) for x in extra_tma_operands))
        reasons = self.derived.get(key)
        if reasons is None:
            scope = variant.gluon_scope
            if scope is None:
                reasons = (f"{variant.value} has no Gluon kernel",)
            else:
                reasons = tuple(scope.not_supported_reasons(self, extra_tma_operands))
            self.derived[key] = reasons
        return list(reasons)


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    forced: Mapping[str, KernelConfig] | None = None,
    counts: dict[KernelVariant, torch.Tensor] | None = None,
    descale: torch.Tensor | None = None,
) -> PreparedCall:
    """The prepared call of validated inputs (``problem`` from ``attnzoo.validation``); inputs are never copied unless
    their strides could wrap int32 offsets inside a tile.  ``descale``: FP8 inputs' float32 ``[B, Hkv, 3]`` factors
    (``attnzoo.fp8``).

    A call whose signature (``_signature``) was prepared before is that call's template with the new tensors: every
    field but q, k and v follows from the signature.
    """
    signature = _signature(q, k, v, problem, forced, counts, descale)
    if signature is not None:
        template = _TEMPLATES.get(signature)
        if template is not None:
            return template.with_tensors(q, k, v)
    call = _prepare(q, k, v, problem, forced, counts, descale)
    if signature is not None and call.q is q and call.k is k and call.v is v:  # no copies were needed
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        call.template_id = next(_TEMPLATE_IDS)
        _TEMPLATES[signature] = call.with_tensors(None, None, None)  # the template keeps no tensor alive
    return call


# Prepared calls by signature: repeated dense calls (a training loop) skip deriving the same fields.
_TEMPLATES: dict[tuple, PreparedCall] = {}
_TEMPLATES_MAX = 256
# Never reused (an evicted template's number stays with the kernels launched under it).
_TEMPLATE_IDS = itertools.count()


def _signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    forced: Mapping[str, KernelConfig] | None,
    counts: dict | None,
    descale: torch.Tensor | None,
) -> tuple | None:
    """What a dense call's ``PreparedCall`` follows from, or None for a call prepared afresh every time (tile counters,
    FP8 factors, ``seqlens_k``, ALiBi slopes or a packed batch: tensors of their own, read into the call).

    The problem (shapes, dtype, device, every argument), the forced configs, and of q, k, v their strides and base
    addresses modulo 16 (TMA addressability, Triton's alignment specialisation); the dot precision follows PyTorch's
    TF32 switch, and the soft cap's tanh Triton's interpreter switch.  The device's properties are fixed for the
    process.
    """
    if counts is not None or descale is not None or problem.seqlens_k is not None or problem.alibi_slopes is not None:
        return None
    if problem.cu_seqlens_q is not None:
        return None
    return (
        problem, tuple(forced.items()) if forced else (), dot_precision(problem.dtype), triton_interpreter_active(),
        q.stride(), k.stride(), v.stride(), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
    )  # fmt: skip


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    forced: Mapping[str, KernelConfig] | None,
    counts: dict[KernelVariant, torch.Tensor] | None,
    descale: torch.Tensor | None,
) -> PreparedCall:
    q, k, v = (int32_addressable(x) for x in (q, k, v))
    block_d = head_dim_tile(problem.head_dim)
    if descale is not None:  # an FP8 product reduces over at least 32 elements (the head dim in q k^T)
        block_d = max(block_d, 32)
    block_dv = value_tile_width(problem.head_dim, problem.head_dim_v, block_d, v)
    varlen = problem.is_varlen
    if varlen:  # packed: the kernels' lengths are the totals; windows are clamped by them (the hints may be loose)
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]
        modifiers = ScoreModifiers.of(problem, q.device, block_d, block_dv, bound=seqlen_q + seqlen_k)
        # Bisection steps over the B + 1 offsets: ceil(log2(B + 1)).
        varlen_args = (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.batch, problem.batch.bit_length())
    else:
        seqlen_q, seqlen_k = problem.seqlen_q, problem.seqlen_k
        modifiers = ScoreModifiers.of(problem, q.device, block_d, block_dv)
        varlen_args = (_placeholder(q.device), _placeholder(q.device), 0, 0)
    if problem.seqlens_k is not None:
        seqlens = problem.seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    else:
        seqlens = _placeholder(q.device)  # never read
    return PreparedCall(
        q=q,
        k=k,
        v=v,
        problem=problem,
        seqlens=seqlens,
        forced=dict(forced) if forced else {},  # a copy: templates outlive the caller's mapping
        counts=counts,
        scale=problem.scale,
        causal=problem.causal,
        has_seqlens=problem.has_seqlens_k,
        group_size=problem.heads // problem.kv_heads,
        seqlen_k=seqlen_k,
        block_d=block_d,
        even_d=problem.head_dim == block_d,
        dot_precision=dot_precision(problem.dtype),
        # The fold needs the softmax's input to be the raw scores times a positive scale: not with a modifier.
        # FP8's factors multiply the scale inside the kernel, and may be negative: no fold either.
        fold_scale=folds_scale(problem.scale, block_d)
        and not (modifiers.softcap or modifiers.alibi or descale is not None),
        debug=counts is not None,
        block_dv=block_dv,
        modifiers=modifiers,
        seqlen_q=seqlen_q,
        varlen=varlen,
        varlen_args=varlen_args,
        descale=descale,
    )


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 on the CPU, where the interpreter runs the kernels)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _cuda_sm_count(index: int) -> int:
    count = _SM_COUNTS.get(index)
    if count is None:  # torch's query costs host time per call: asked once per device
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


@dataclass(frozen=True)
class GluonScope:
    """Where a variant's Gluon Hopper kernel runs, declared once (as a backend's ``Capabilities``); elsewhere its
    ``gluon`` configs run the Triton kernel with the same tiles, and the tuner does not time them twice.

    Common to every Gluon kernel: an sm_90 NVIDIA GPU (not the interpreter, not ROCm), float16/bfloat16 with the head
    dims of ``head_dims`` (or FP8 inputs with those of ``fp8_head_dims``), no ``seqlens_k`` (TMA zero-fills past Nk
    only: K/V rows past ``seqlens_k[b]`` arrive as they are, and a NaN there makes P V or dP NaN even where P = 0), no
    debug build (no tile counters), and q, k, v (and ``extra_tma_operands``) addressable by TMA (FP8's v through its
    keys-contiguous view).
    """

    kernel_file: str
    needs_positive_scale: bool  # the kernel folds the scale into exp2's argument
    # The (D, Dv) pairs the kernel has tiles for and a GPU test has checked against the oracle.
    head_dims: tuple[tuple[int, int], ...] = ((64, 64), (128, 128))
    extra_tma_operands: tuple[str, ...] = ()  # names of the further tensors it loads by TMA, passed to the check
    # The score modifiers the kernel applies (SPEC.md); a call with another one runs the Triton kernel.
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False  # packed batches (``attention_varlen``)
    # FP8 inputs (``attention_fp8``): the (D, Dv) pairs the kernel takes them with (none: it takes no FP8).
    fp8_head_dims: tuple[tuple[int, int], ...] = ()

    def modifier_reasons(self, modifiers: ScoreModifiers) -> list[str]:
        """The score modifiers of a call that the kernel does not apply."""
        reasons = []
        if (modifiers.window_left_bounded or modifiers.window_right_bounded) and not self.window:
            reasons.append("window: the kernel has no sliding-window bounds")
        if modifiers.softcap and not self.softcap:
            reasons.append("softcap: the kernel has no soft cap")
        if modifiers.alibi and not self.alibi:
            reasons.append("alibi_slopes: the kernel has no ALiBi term")
        return reasons

    def head_dim_reasons(self, head_dim: int, head_dim_v: int) -> list[str]:
        """Why the kernel does not take these head dims ([] when it does)."""
        if (head_dim, head_dim_v) in self.head_dims:
            return []
        pairs = ", ".join(f"D={d} Dv={dv}" for d, dv in self.head_dims)
        return [f"head dims D={head_dim} Dv={head_dim_v}: {pairs} only"]

    def not_supported_reasons(self, call: PreparedCall, extra: tuple[torch.Tensor, ...] = ()) -> list[str]:
        q = call.q
        unavailable = gluon_unavailable_reason()
        if unavailable:
            return [unavailable]
        if triton_interpreter_active() or not q.is_cuda or torch.version.hip is not None:
            return ["Gluon's Hopper kernels run on an NVIDIA GPU only (not in the interpreter, not on ROCm)"]
        reasons = []
        if _compute_capability_major(q.device.index or 0) != 9:
            reasons.append("wgmma needs an sm_90 (Hopper) GPU")
        head_dims = (call.problem.head_dim, call.problem.head_dim_v)
        v_boxes = call.v
        if call.descale is not None:
            if head_dims not in self.fp8_head_dims:
                reasons.append(f"FP8 inputs with D={head_dims[0]} Dv={head_dims[1]}: " + (
                    ", ".join(f"D={d} Dv={dv}" for d, dv in self.fp8_head_dims) + " only" if self.fp8_head_dims
                    else "this Gluon kernel takes float16 and bfloat16 only"
                ))  # fmt: skip
            v_boxes = call.v.transpose(-1, -2)  # FP8 reads V keys-contiguous, as [B, Hkv, Dv, Nk]
        else:
            if q.dtype not in HOPPER_DTYPES:
                reasons.append(f"dtype {q.dtype}: float16 and bfloat16 only")
            reasons.extend(self.head_dim_reasons(*head_dims))
        if call.has_seqlens:
            reasons.append("seqlens_k: the K/V rows past seqlens_k[b] may hold anything, and TMA cannot zero them")
        if call.varlen and not self.varlen:
            reasons.append("packed variable-length batches: this Gluon kernel addresses dense [B, H, N, D] tensors")
        reasons.extend(self.modifier_reasons(call.modifiers))
        if self.needs_positive_scale and not call.scale > 0:
            reasons.append("scale <= 0: the kernel folds a positive scale into exp2's argument")
        if call.debug:
            reasons.append("debug mode: the Gluon kernels keep no tile counts")
        if len(extra) != len(self.extra_tma_operands) or not all(descriptor_loads_possible(x) for x in extra):
            names = " and ".join(self.extra_tma_operands)
            reasons.append(f"{names} not addressable by TMA (empty, or not: last stride 1, 16-byte aligned strides)")
        if not all(descriptor_loads_possible(x) for x in (q, call.k, v_boxes)):
            reasons.append("q, k or v not addressable by TMA (empty, or not: last stride 1, 16-byte aligned strides)")
        return reasons


_GLUON_SCOPES = {
    # The Gluon forward's modifiers and its two-part head dim (192 = 128 + 64, DeepSeek's MLA with Dv = 128) are
    # checked against the oracle by tests/test_gpu_score_modifiers.py::test_gluon_forward_applies_each_modifier_it_
    # implements and ::test_gluon_forward_takes_a_head_dim_in_two_parts; D = 256 (with each modifier) by
    # tests/test_gpu.py::test_gluon_forward_at_head_dim_256, packed by tests/test_gpu_varlen.py's "wide" case.
    KernelVariant.FORWARD: GluonScope(
        "forward_gluon.py",
        needs_positive_scale=True,
        head_dims=((64, 64), (128, 128), (192, 128), (256, 256)),
        window=True,
        softcap=True,
        alibi=True,
        varlen=True,
        # tests/test_fp8.py::test_gluon_fp8_forward_on_the_gpu
        fp8_head_dims=((64, 64), (128, 128)),
    ),
    # Its windows, soft cap and ALiBi: tests/test_gpu_score_modifiers.py::test_gluon_dkdv_applies_sliding_windows
    # and ::test_gluon_dkdv_applies_alibi_and_the_soft_cap.  D = 256 and D = 192 with Dv = 128 run the head-dim-split
    # kernel of backward_gluon_wide.py (tests/test_gpu.py::test_gluon_dkdv_at_wide_head_dims, with each score
    # modifier; packed batches: tests/test_gpu_varlen.py's "wide" cases).
    KernelVariant.DKDV: GluonScope(
        "backward_gluon.py",
        needs_positive_scale=False,
        head_dims=((64, 64), (128, 128), (192, 128), (256, 256)),
        extra_tma_operands=("do",),
        window=True,
        softcap=True,
        alibi=True,
        varlen=True,
    ),
    # Its windows, soft cap, ALiBi and packed batches: tests/test_gpu_score_modifiers.py::test_gluon_dq_applies_each_
    # modifier and tests/test_gpu_varlen.py (the gluon configs pinned).
    # D = 256 and D = 192 with Dv = 128: the head-dim-split kernel of backward_gluon_wide.py, as for DKDV
    # (test_gluon_dq_at_wide_head_dims).
    KernelVariant.DQ: GluonScope(
        "backward_gluon_dq.py",
        needs_positive_scale=False,
        head_dims=((64, 64), (128, 128), (192, 128), (256, 256)),
        extra_tma_operands=("do", "o"),  # o is read by pointer loads; the check keeps its rows contiguous
        window=True,
        softcap=True,
        alibi=True,
        varlen=True,
    ),
}
# The same kernel with dQ added atomically (the five-product backward, in any or a fixed order): dense calls, checked
# by tests/test_gpu.py::test_five_product_backward_matches_the_oracle and the two tests named above.
_GLUON_SCOPES[KernelVariant.ATOMIC_PREPROCESS] = _GLUON_SCOPES[KernelVariant.ATOMIC_ORDERED] = replace(
    _GLUON_SCOPES[KernelVariant.DKDV], head_dims=((64, 64), (128, 128)), varlen=False
)


def _tuning_key(call: PreparedCall, variant: KernelVariant, gluon_in_scope: bool) -> tuple:
    """The tuning key of ``variant`` on ``call`` (``tuning.launch_with_best``; remembered in ``call.derived``)."""
    derived_key = ("tuning key", variant, gluon_in_scope)
    key = call.derived.get(derived_key)
    if key is not None:
        return key
    q = call.q
    key = call.derived[derived_key] = (
        variant.value,
        call.block_d,
        q.dtype,
        call.causal,
        call.has_seqlens,
        seqlen_bucket(call.problem.seqlen_q),  # packed: the longest sequence's (its hint)
        seqlen_bucket(call.problem.seqlen_k),
        call.dot_precision,
        call.modifiers.key,
        # The Gluon kernels' tiles hold the exact head dims (192 as 128 + 64), the Triton kernels' the tile BLOCK_D:
        # where Gluon runs a head dim below its tile, the key says which, so that no other head dim takes its winner.
        f"D={call.problem.head_dim}" if gluon_in_scope and call.problem.head_dim != call.block_d else "",
        # FP8 calls of one key split between the kernels (the Gluon one needs Nk a multiple of 16, for TMA rows of
        # v's keys-contiguous view): those on the Triton kernel keep their winner apart.
        "triton" if call.descale is not None and not gluon_in_scope else "",
        q.device.index,
    )
    return key


def run(
    call: PreparedCall,
    variant: KernelVariant,
    launch: Callable[[KernelConfig], None],
    reset: Callable[[], None] | None = None,
    gluon_in_scope: bool = False,
) -> KernelConfig:
    """Launch ``variant`` with the forced, the interpreter's or the tuner's config; returns the config used.

    ``reset`` zeroes accumulation buffers; it runs before every launch of the kernel, so tuning trials never leave
    partial sums behind.  ``gluon_in_scope``: ``launch`` runs the Gluon kernel for a ``gluon`` config
    (``call.gluon_reasons`` is empty); otherwise such a config would run its Triton twin, and the tuner skips it.
    """
    cfg = call.forced.get(variant.kernel) if call.forced else None
    if cfg is not None or triton_interpreter_active():
        cfg = cfg if cfg is not None else INTERPRETER_CONFIG
        if reset is not None:
            reset()
        launch(cfg)
        return cfg
    q = call.q
    key = _tuning_key(call, variant, gluon_in_scope)

    def configs_in_scope() -> list[KernelConfig]:
        head_dims = (call.problem.head_dim, call.problem.head_dim_v) if gluon_in_scope else None
        configs = tuning.candidates(variant.kernel, call.block_d, q.dtype, q.device, head_dims, call.block_dv)
        # Configs that would launch as a twin of another candidate here are not tried twice: TMA ones without
        # descriptors (their pointer twin), Gluon ones outside its scope (the Triton kernel with the same tiles).
        if any(c.tma for c in configs) and not call.kv_descriptors:
            configs = [c for c in configs if not c.tma] or configs
        if any(c.gluon for c in configs) and not gluon_in_scope:
            configs = [c for c in configs if not c.gluon] or configs
        if variant is KernelVariant.ATOMIC_ORDERED:  # the ordered dQ is a Gluon kernel's
            configs = [c for c in configs if c.gluon]
        if call.varlen or call.descale is not None:  # one Q block per program: persistent runs its Triton twin
            configs = [c for c in configs if not c.persistent] or configs
        return configs

    return tuning.launch_with_best(key, configs_in_scope, launch, reset)
