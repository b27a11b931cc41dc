"""Every implementation the benchmark times, behind one adapter.

An *impl* is an attnzoo backend, named by an impl spec: ``name``, or ``name:key=value,key=value`` for the variant
``attnzoo.get(name, key=value, ...)`` (e.g. ``triton_atomic:delta=recompute``); or a torch SDPA backend forced with
``torch.nn.attention.sdpa_kernel`` (``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``); or
``flex_attention`` (torch's FlexAttention wrapped in ``torch.compile``, with a causal ``BlockMask`` when causal).
This module adapts the torch peers; the variants of attnzoo's backends are ``attnzoo.get`` options, listed nowhere
else.

How the backward is timed alone:

* attnzoo backends: one forward gives ``o`` and ``lse``; the timed call is ``backend.backward(do, q, k, v, o,
  lse, ...)`` on those saved tensors.
* SDPA and FlexAttention: one forward on leaf inputs with ``requires_grad`` builds the autograd graph; the
  timed call is ``torch.autograd.grad(out, (q, k, v), do, retain_graph=True)`` on that retained graph.

In ``fwd`` mode SDPA and FlexAttention run on inputs without ``requires_grad`` (inference); in ``train`` mode
their forward runs with autograd recording, as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import attnzoo
from attnzoo.backends import key_band, tile_is_empty

Tensor = torch.Tensor


@dataclass(frozen=True)
class Inputs:
    """One case's tensors: q ``[B, H, N, D]``, k/v ``[B, Hkv, N, D]``, do like q (None in fwd mode, so that it
    does not count in the forward's peak memory), seqlens_k ``[B]`` or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor | None
    causal: bool
    seqlens_k: Tensor | None

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass
class Prepared:
    """Closures over one case; building them does no device work.

    ``step()`` runs one complete step from the inputs alone (forward, and backward in train mode): the warm-up
    and the peak-memory measurement use it.  ``forward()`` is one forward.  ``make_backward()`` (train mode)
    runs one forward whose results it keeps, and returns the closure of one backward on them.
    """

    step: Callable[[], Any]
    forward: Callable[[], Any]
    make_backward: Callable[[], Callable[[], Any]] | None


class Impl:
    """Adapter interface: support questions, the prepared closures, and the tile skip ratio."""

    name: str
    gpu_only: bool = False

    def reasons(self, inputs: Inputs) -> list[str]:
        """Why this impl cannot run the case ([] when it can)."""
        if self.gpu_only and inputs.device.type != "cuda":
            return ["needs CUDA"]
        return []

    def prepare(self, inputs: Inputs, train: bool) -> Prepared:
        raise NotImplementedError

    def skip_ratio(self, inputs: Inputs) -> float | None:
        """Fraction of the score tiles skipped without work (causal/padding early exit), None if unknown."""
        return None

    def forward_code(self) -> object | None:
        """What runs this impl's forward, when another impl may run the very same (None: unknown, or its own)."""
        return None


def geometric_skip_ratio(
    n_q: int, n_k: int, block_m: int, block_n: int, causal: bool, seqlens_k: list[int] | None
) -> float:
    """Fraction of ``block_m x block_n`` tiles of the score matrix that are fully masked.

    Computed from the causal/padding geometry with the kernel's block sizes (the same test the blocked
    backends use to skip a tile, :func:`attnzoo.backends.tile_is_empty`), averaged over the batch.
    """
    lengths = seqlens_k if seqlens_k is not None else [n_k]
    band = key_band(causal, None)
    total = skipped = 0
    for length in lengths:
        for m0 in range(0, n_q, block_m):
            m1 = min(m0 + block_m, n_q)
            for n0 in range(0, n_k, block_n):
                total += 1
                skipped += tile_is_empty(m0, m1, n0, min(n0 + block_n, n_k), n_q, n_k, band, length)
    return skipped / total if total else 0.0


def _block_sizes(backend: Any) -> tuple[int, int] | None:
    """The (block_m, block_n) a backend declares, if it declares them (as attributes or module constants)."""
    for owner in (backend, __import__(type(backend).__module__, fromlist=["_"])):
        for m_name, n_name in (("block_m", "block_n"), ("BLOCK_M", "BLOCK_N")):
            m, n = getattr(owner, m_name, None), getattr(owner, n_name, None)
            if isinstance(m, int) and isinstance(n, int):
                return m, n
    return None


_TRITON_DEBUG_BACKENDS = ("triton_2kernel", "triton_atomic")


def _option_value(text: str) -> Any:
    """An option value of an impl spec: a bool for ``true``/``false``, an int where it reads as one, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def parse_impl_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` -> ``(name, {key: value, ...})``; ``"name"`` -> ``(name, {})``.

    Values are bools (``true``/``false``) and ints where they read as one, else strings; a dotted key builds a
    dict, so that ``configs.forward=128x64 w8 s3`` gives ``{"configs": {"forward": "128x64 w8 s3"}}``.
    """
    name, _, option_text = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in option_text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ValueError(f"impl spec {spec!r}: option {item!r} is not key=value")
        *outer, last = key.split(".")
        target = options
        for part in outer:
            target = target.setdefault(part, {})
        target[last] = _option_value(value)
    return name.strip(), options


def split_impl_list(text: str) -> list[str]:
    """A comma list of impl specs: ``"triton_2kernel,triton_atomic:delta=recompute,sdpa_flash"``.

    An option of a spec is separated by a comma too; an item with ``=`` and no ``:`` continues the spec before it.
    """
    specs: list[str] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" in item and ":" not in item and specs:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


# The CSV label of a spec is the spec itself, except where committed results name it otherwise: the H100 grids in
# bench/results call the recompute variant of triton_atomic by this name.
LABELS = {"triton_atomic:delta=recompute": "triton_atomic_recompute"}


def impl_label(spec: str) -> str:
    """The name of an impl in CSVs and figures: its spec, options in the order given, or its entry in ``LABELS``."""
    name, options = parse_impl_spec(spec)
    flat = []
    for key, value in options.items():
        pairs = value.items() if isinstance(value, dict) else [(None, value)]
        flat += [f"{key}{'' if sub is None else '.' + sub}={v}" for sub, v in pairs]
    canonical = name + (":" + ",".join(flat) if flat else "")
    return LABELS.get(canonical, canonical)


class BackendImpl(Impl):
    """An attnzoo backend or a variant of it, ``attnzoo.get(name, **options)``; ``forward``/``backward`` are the
    backend's own calls."""

    def __init__(self, spec: str):
        self.backend_name, self.options = parse_impl_spec(spec)
        self.name = impl_label(spec)
        self.backend = attnzoo.get(self.backend_name, **self.options)

    def forward_code(self) -> object | None:
        """The backend class's forward: triton_2kernel and triton_atomic (and its variant) share one kernel."""
        return type(self.backend)._forward

    def reasons(self, inputs: Inputs) -> list[str]:
        i = inputs
        try:
            return self.backend.not_supported_reasons(i.q, i.k, i.v, causal=i.causal, seqlens_k=i.seqlens_k)
        except ValueError as exc:  # beyond the backend's limits (e.g. its largest head dim): a skipped case
            return [str(exc)]

    def prepare(self, inputs: Inputs, train: bool) -> Prepared:
        be, i = self.backend, inputs

        def forward():
            return be.forward(i.q, i.k, i.v, causal=i.causal, seqlens_k=i.seqlens_k)

        def backward_of(o, lse):
            return be.backward(i.do, i.q, i.k, i.v, o, lse, causal=i.causal, seqlens_k=i.seqlens_k)

        def step():
            o, lse = forward()
            return backward_of(o, lse) if train else o

        def make_backward():
            o, lse = forward()  # saved once; the timed backward reuses them
            return lambda: backward_of(o, lse)

        return Prepared(step, forward, make_backward if train else None)

    def skip_ratio(self, inputs: Inputs) -> float | None:
        i = inputs
        if self.backend_name in _TRITON_DEBUG_BACKENDS:
            # Counted by the forward kernel itself (attnzoo.debug: a DEBUG build counts loaded and skipped K/V
            # tiles per program), with the debug build's fixed 64 x 64 tiles rather than the autotuned ones.
            from attnzoo.debug import tile_counts

            counts = tile_counts(self.backend, i.q, i.k, i.v, causal=i.causal, seqlens_k=i.seqlens_k)
            visited, skipped = int(counts.visited.sum()), int(counts.skipped.sum())
            return skipped / (visited + skipped) if visited + skipped else 0.0
        # Python-loop backends: the causal/padding geometry with the backend's own block sizes.
        blocks = _block_sizes(self.backend)
        if blocks is None:
            return None
        n_q, n_k = inputs.q.shape[2], inputs.k.shape[2]
        lengths = None if inputs.seqlens_k is None else inputs.seqlens_k.tolist()
        return geometric_skip_ratio(n_q, n_k, *blocks, inputs.causal, lengths)


def _autograd_prepared(inputs: Inputs, train: bool, run: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Prepared:
    """Prepared closures for an autograd-differentiated impl (SDPA, FlexAttention)."""
    i = inputs
    if not train:

        def inference():
            with torch.no_grad():
                return run(i.q, i.k, i.v)

        return Prepared(inference, inference, None)

    leaves = [t.detach().requires_grad_(True) for t in (i.q, i.k, i.v)]

    def forward():
        return run(*leaves)

    def step():
        return torch.autograd.grad(run(*leaves), leaves, i.do)

    def make_backward():
        out = forward()  # the graph that the timed backward differentiates again and again
        return lambda: torch.autograd.grad(out, leaves, i.do, retain_graph=True)

    return Prepared(step, forward, make_backward)


def _key_padding_mask(inputs: Inputs) -> Tensor | None:
    """Boolean ``[B, 1, N, Nk]`` mask (True = attend) for SDPA when there are key lengths, else None."""
    i = inputs
    if i.seqlens_k is None:
        return None
    n_q, n_k = i.q.shape[2], i.k.shape[2]
    cols = torch.arange(n_k, device=i.device)
    mask = (cols[None, :] < i.seqlens_k[:, None])[:, None, None, :].expand(-1, 1, n_q, -1)
    if i.causal:  # SDPA takes attn_mask or is_causal, not both
        rows = torch.arange(n_q, device=i.device)
        mask = mask & (cols[None, :] <= rows[:, None] + (n_k - n_q))
    return mask


class SdpaImpl(Impl):
    """``torch.nn.functional.scaled_dot_product_attention`` forced onto one SDPA backend."""

    def __init__(self, name: str, sdpa_backend: str, gpu_only: bool):
        self.name, self.sdpa_backend, self.gpu_only = name, sdpa_backend, gpu_only

    def reasons(self, inputs: Inputs) -> list[str]:
        reasons = super().reasons(inputs)
        if inputs.seqlens_k is not None and self.sdpa_backend == "FLASH_ATTENTION":
            reasons.append("SDPA flash takes no attention mask (key lengths)")
        return reasons

    def prepare(self, inputs: Inputs, train: bool) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, self.sdpa_backend)
        mask = _key_padding_mask(inputs)
        is_causal = inputs.causal and mask is None
        gqa = inputs.q.shape[1] != inputs.k.shape[1]

        def run(q, k, v):
            with sdpa_kernel(backend):
                if gqa:
                    return sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
                return sdpa(q, k, v, attn_mask=mask, is_causal=is_causal)

        return _autograd_prepared(inputs, train, run)


_compiled_flex: Callable | None = None


def _flex() -> Callable:
    """``flex_attention`` compiled once per process (recompiled by dynamo per shape; the cache limit is raised)."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        import torch._functorch.config
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled graph per (shape, dtype, requires_grad): a grid has dozens, above dynamo's default limit
        # of 8, after which it would silently fall back to eager (materialising the scores).
        torch._dynamo.config.cache_size_limit = 1024
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        # The timed backward differentiates one retained graph again and again (retain_graph=True), which a
        # compiled backward with donated buffers refuses.
        torch._functorch.config.donated_buffer = False
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexImpl(Impl):
    """torch's FlexAttention, compiled; causal and key lengths become a ``BlockMask``."""

    name = "flex_attention"
    gpu_only = True

    def _block_mask(self, inputs: Inputs):
        from torch.nn.attention.flex_attention import create_block_mask

        i = inputs
        if not i.causal and i.seqlens_k is None:
            return None
        n_q, n_k = i.q.shape[2], i.k.shape[2]
        lengths, causal, offset = i.seqlens_k, i.causal, n_k - n_q

        def mask_mod(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx + offset if causal else kv_idx >= 0
            if lengths is not None:
                keep = keep & (kv_idx < lengths[b])
            return keep

        batch = None if lengths is None else i.q.shape[0]
        return create_block_mask(mask_mod, batch, None, n_q, n_k, device=i.device)

    def prepare(self, inputs: Inputs, train: bool) -> Prepared:
        flex, block_mask = _flex(), self._block_mask(inputs)
        gqa = inputs.q.shape[1] != inputs.k.shape[1]

        def run(q, k, v):
            return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

        return _autograd_prepared(inputs, train, run)

    def skip_ratio(self, inputs: Inputs) -> float | None:
        block_mask = self._block_mask(inputs)
        return 0.0 if block_mask is None else block_mask.sparsity() / 100.0


SDPA_IMPLS = {
    "sdpa_flash": ("FLASH_ATTENTION", False),  # torch also has a CPU flash kernel
    "sdpa_cudnn": ("CUDNN_ATTENTION", True),
    "sdpa_efficient": ("EFFICIENT_ATTENTION", True),
    "sdpa_math": ("MATH", False),
}


def impl_names() -> list[str]:
    """Every impl the benchmark knows by name: registered backends, SDPA and FlexAttention (a backend's variants are
    specs, ``name:key=value``)."""
    return [*attnzoo.names(), *SDPA_IMPLS, "flex_attention"]


def get_impl(spec: str) -> Impl:
    """The adapter of an impl spec (ValueError listing the known names otherwise; TypeError for an option the
    backend does not take)."""
    name, options = parse_impl_spec(spec)
    if name in attnzoo.names():
        return BackendImpl(spec)
    if options:
        raise ValueError(
            f"impl {name!r} takes no options; variants are of attnzoo backends: {', '.join(attnzoo.names())}"
        )
    if name in SDPA_IMPLS:
        return SdpaImpl(name, *SDPA_IMPLS[name])
    if name == "flex_attention":
        return FlexImpl()
    raise ValueError(f"unknown impl {name!r}; known: {', '.join(impl_names())} (a backend variant: name:key=value,...)")


def default_impls(cuda: bool) -> list[str]:
    """Impls benchmarked when ``--impl`` is not given: all of them on a GPU, the CPU-capable ones otherwise."""
    if cuda:
        return impl_names()
    cpu_backends = [n for n in attnzoo.names() if "cpu" in attnzoo.get(n).capabilities.devices]
    return [*cpu_backends, "sdpa_flash", "sdpa_math"]
