"""Ring attention: ``ring_attention``, ``shard`` and ``unshard`` (SPEC.md, "Sequence (context) parallelism").

Each of ``W`` ranks holds a part of the sequence (:mod:`.layout`) of q, k and v.  The forward runs ``W`` steps; at
step ``s`` rank ``r`` holds the K/V block of rank ``(r - s) mod W``, starts passing it on to rank ``r + 1`` (and
receiving the next from ``r - 1``: double buffering), attends its queries to the block in hand with the local
backend (the calls :mod:`.plan` chose: fully masked chunk pairs are skipped), and merges the result into its running
``(o, lse)`` by the log-sum-exp (:func:`attnzoo.merge_attention`).  The backward runs the ring again: each rank's
backend backward on the block in hand with the *global* ``o`` and ``lse`` (which make ``P = exp(S - lse)`` the block
of the whole softmax) gives this block's share of dQ, added locally, and of dK/dV, added into an accumulator that
travels with the block and reaches its owner after the last step.  The accumulator travels in float32 (float64 for
float64 inputs), so dK/dV are rounded to their dtype once.

The calls go through custom operators (``attnzoo::ring_attention_forward``, ``attnzoo::ring_attention_backward``,
``attnzoo::unshard``) with shape-only fake implementations and an autograd formula, as :mod:`attnzoo.autograd` does;
the process group travels by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..autograd import _backend_of, backend_key, default_scale
from ..merge import merge_attention
from ..validation import _validate_window, lse_dtype, validate_forward
from . import layout as layouts
from .plan import Launch, ring_plan
from .ring import TAG_DKV, TAG_KV, Ring, group_name, resolve

Tensor = torch.Tensor


# -- the work of one rank -------------------------------------------------------------------------------------------
class _Call:
    """The arguments every local call of one ring attention shares, and this rank's plan."""

    def __init__(self, q, k, v, causal, scale, window_left, window_right, softcap, group, layout, backend):
        self.ring = Ring(resolve(group))
        world = self.ring.world
        layouts.check_layout(layout)
        validate_forward(q, k, v, causal, scale, None, None, softcap)  # shapes, dtypes, devices, scale, softcap
        for name, x in (("q", q), ("k", k)):
            layouts.check_divisible(name, x.shape[2], world, layout, local=True)
        window = None if window_left is None and window_right is None else (window_left, window_right)
        self.window = _validate_window(window, q.shape[2] * world, k.shape[2] * world)  # relative to the whole
        if q.device.type == "cpu" and str(dist.get_backend(self.ring.group)).lower() == "nccl":
            raise ValueError(f"q is on {q.device} but the process group is NCCL's, which moves CUDA tensors only")
        self.causal, self.scale, self.softcap, self.backend = causal, scale, softcap, backend
        self.plan = ring_plan(self.ring.rank, world, layout, q.shape[2], k.shape[2], causal, self.window)
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Every local call checked before any kernel or transfer: the K/V in hand has the shape of the local k, v.
        self.backends = {}
        for launch in {launch for step in self.plan for launch in step}:
            args = (q[:, :, slice(*launch.rows)], k[:, :, slice(*launch.keys)], v[:, :, slice(*launch.keys)])
            kw = self.kwargs(launch)
            problem = validate_forward(*args, kw["causal"], scale, None, kw["window"], softcap)
            chosen = _backend_of(backend, problem)
            reasons = chosen.not_supported_reasons(*args, **kw)  # a head dim above its limit: ValueError
            if reasons:
                raise NotImplementedError(f"backend {chosen.name!r} cannot run a local call: " + "; ".join(reasons))
            self.backends[launch] = chosen

    def kwargs(self, launch: Launch) -> dict:
        return dict(causal=launch.causal, scale=self.scale, window=launch.window, softcap=self.softcap)

    def calls(self, step: int):
        for launch in self.plan[step]:
            yield launch, self.backends[launch], slice(*launch.rows), slice(*launch.keys), self.kwargs(launch)


def _pack(*tensors: Tensor) -> Tensor:
    """One contiguous flat buffer holding ``tensors`` (one transfer per step instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buffer: Tensor, *like: Tensor) -> list[Tensor]:
    views, start = [], 0
    for t in like:
        views.append(buffer[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return views


def _spare(buffers: list, step: int, like: Tensor) -> Tensor:
    """The buffer that receives step ``step``'s block: the other of the two (double buffering), allocated on first
    use.  It is free: the transfer that last sent from it was waited on before this step began."""
    if buffers[step % 2] is None:
        buffers[step % 2] = torch.empty_like(like)
    return buffers[step % 2]


def _ring_forward(q, k, v, call: _Call) -> tuple[Tensor, Tensor]:
    ring, world = call.ring, call.ring.world
    B, H, n_q, _ = q.shape
    o_acc = q.new_zeros((B, H, n_q, v.shape[-1]), dtype=call.acc_dtype)
    lse_acc = torch.full((B, H, n_q), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    buffers = [_pack(k, v), None]
    for step in range(world):
        held = buffers[step % 2]
        transfer = None
        if step + 1 < world:  # the next block travels while this one is attended
            transfer = ring.shift(held, _spare(buffers, step + 1, held), TAG_KV)
        k_held, v_held = _unpack(held, k, v)
        for _launch, backend, rows, keys, kw in call.calls(step):
            o_part, lse_part = backend.forward(q[:, :, rows], k_held[:, :, keys], v_held[:, :, keys], **kw)
            o_acc[:, :, rows], lse_acc[:, :, rows] = merge_attention(
                [o_acc[:, :, rows], o_part.to(call.acc_dtype)], [lse_acc[:, :, rows], lse_part]
            )
        if transfer is not None:
            transfer.wait()
    return o_acc.to(q.dtype), lse_acc


def _ring_backward(do, q, k, v, o, lse, call: _Call) -> tuple[Tensor, Tensor, Tensor]:
    ring, world = call.ring, call.ring.world
    dq_acc = torch.zeros(q.shape, dtype=call.acc_dtype, device=q.device)
    kv_buffers = [_pack(k, v), None]
    # The dK/dV accumulator of the block in hand; it leaves with the block's share of this rank added.
    dkv_buffers = [torch.zeros(k.numel() + v.numel(), dtype=call.acc_dtype, device=k.device), None]
    dkv_transfer = None
    for step in range(world):
        held = kv_buffers[step % 2]
        kv_transfer = None
        if step + 1 < world:
            kv_transfer = ring.shift(held, _spare(kv_buffers, step + 1, held), TAG_KV)
        k_held, v_held = _unpack(held, k, v)
        shares = []
        for _launch, backend, rows, keys, kw in call.calls(step):
            dq, dk, dv = backend.backward(
                do[:, :, rows], q[:, :, rows], k_held[:, :, keys], v_held[:, :, keys], o[:, :, rows],
                lse[:, :, rows], **kw,
            )  # fmt: skip
            dq_acc[:, :, rows] += dq
            shares.append((keys, dk, dv))
        accumulator = dkv_buffers[0] if dkv_transfer is None else dkv_transfer.wait()
        dk_acc, dv_acc = _unpack(accumulator, k, v)
        for keys, dk, dv in shares:
            dk_acc[:, :, keys] += dk
            dv_acc[:, :, keys] += dv
        if world > 1:  # to the next rank; after the last step, that is the block's owner
            dkv_transfer = ring.shift(accumulator, _spare(dkv_buffers, step + 1, accumulator), TAG_DKV)
        if kv_transfer is not None:
            kv_transfer.wait()
    own = dkv_buffers[0] if dkv_transfer is None else dkv_transfer.wait()
    dk, dv = _unpack(own, k, v)
    # Copies: dk and dv are views of one buffer, and an operator's outputs may not alias each other.
    return dq_acc.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)


# -- the operators --------------------------------------------------------------------------------------------------
@torch.library.custom_op("attnzoo::ring_attention_forward", mutates_args=())
def ring_attention_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    group: str,
    layout: str,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """This rank's ``o`` ``[B, H, n_q, Dv]`` (dtype of q) and ``lse`` ``[B, H, n_q]`` of attention over the whole
    sequence; ``group`` is the process group's name."""
    call = _Call(q, k, v, causal, scale, window_left, window_right, softcap, group, layout, backend)
    return _ring_forward(q, k, v, call)


@ring_attention_forward_op.register_fake
def _(q, k, v, causal, scale, window_left, window_right, softcap, group, layout, backend):
    B, H, n_q, _ = q.shape
    return q.new_empty((B, H, n_q, v.shape[-1])), q.new_empty((B, H, n_q), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("attnzoo::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    group: str,
    layout: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``dq``, ``dk``, ``dv`` (shapes of its q, k, v) from its ``do`` and the forward's ``o``, ``lse``."""
    call = _Call(q, k, v, causal, scale, window_left, window_right, softcap, group, layout, backend)
    return _ring_backward(do, q, k, v, o, lse, call)


@ring_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, window_left, window_right, softcap, group, layout, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *arguments = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.arguments = arguments
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(do, q, k, v, o, lse, *ctx.arguments)
    return dq, dk, dv, *([None] * len(ctx.arguments))


ring_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("attnzoo::unshard", mutates_args=())
def unshard_op(x: Tensor, group: str, layout: str) -> Tensor:
    """The whole tensor along dim 2 from every rank's part ``x``."""
    return layouts.assemble(Ring(resolve(group)).all_gather(x), layout)


@unshard_op.register_fake
def _(x, group, layout):
    shape = list(x.shape)
    shape[2] *= dist.get_world_size(resolve(group))
    return x.new_empty(shape)


def _unshard_setup_context(ctx, inputs, output) -> None:
    _, ctx.group, ctx.layout = inputs


def _unshard_backward(ctx, grad):
    # Every rank holds the whole result and (as when each computes the same loss from it) the same gradient of it:
    # this rank's inputs get their part of it.
    group = resolve(ctx.group)
    return layouts.take(grad, dist.get_rank(group), dist.get_world_size(group), ctx.layout), None, None


unshard_op.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# -- the public calls -----------------------------------------------------------------------------------------------
def _group_rank_world(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    group = resolve(group_name(group))
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_dims(name: str, x: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 3:
        raise ValueError(f"{name} must have at least 3 dims (the sequence is dim 2), got shape {tuple(x.shape)}")


def shard(x: Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag") -> Tensor:
    """This rank's part of ``x`` along dim 2 (the sequence of ``[B, H, N, D]``): chunk ``r`` of ``W`` for
    ``layout="contiguous"``, chunks ``r`` and ``2W - 1 - r`` of ``2W`` for ``"zigzag"``.  ``N`` must split into those
    equal chunks.  Differentiable (slices of ``x``); no communication: every rank passes the whole ``x``."""
    _check_dims("x", x)
    layouts.check_layout(layout)
    _, rank, world = _group_rank_world(group)
    layouts.check_divisible("x", x.shape[2], world, layout, local=False)
    return layouts.take(x, rank, world, layout)


def unshard(x_local: Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag") -> Tensor:
    """The whole tensor along dim 2 from every rank's part (the inverse of :func:`shard`; an all-gather over
    ``group``).  Its gradient on each rank is that rank's part of the gradient of the result."""
    _check_dims("x_local", x_local)
    layouts.check_layout(layout)
    name = group_name(group)
    layouts.check_divisible("x_local", x_local.shape[2], dist.get_world_size(resolve(name)), layout, local=True)
    return unshard_op(x_local, name, layout)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    backend: str = "auto",
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence split across the ranks of ``group`` (context parallelism), with autograd.

    q: this rank's ``[B, H, n_q, D]``; k: ``[B, Hkv, n_k, D]``, v: ``[B, Hkv, n_k, Dv]`` (``shard`` of the whole q, k,
    v with the same ``layout``; ``Nq = W n_q``, ``Nk = W n_k``).  ``causal``, ``scale``, ``window``, ``softcap``:
    SPEC.md's semantics on the whole ``Nq x Nk`` problem (windows relative to its bottom-right diagonal).
    ``backend``: the local kernel, as in :func:`attnzoo.attention`.  Returns this rank's ``o`` ``[B, H, n_q, Dv]``
    (and ``lse`` ``[B, H, n_q]`` with ``return_lse``); ``unshard(o)`` equals ``attention(q, k, v, ...)`` on the whole
    sequence.  ALiBi is not supported: its bias depends on absolute distances, which a chunk pair's local call cannot
    express.  Every rank must call it with the same shapes and arguments.
    """
    if alibi_slopes is not None:
        raise NotImplementedError(
            "ring_attention does not support alibi_slopes (ALiBi): a chunk pair's bias -slope * |i' - j| depends on "
            "the pair's global offset, which a local call's score modifiers cannot express"
        )
    layouts.check_layout(layout)
    name = group_name(group)
    key = backend_key(backend)
    if not torch.compiler.is_compiling():  # traced: the operator checks the shapes when it runs
        validate_forward(q, k, v, causal, scale, None, None, softcap)
        world = dist.get_world_size(resolve(name))
        for arg, x in (("q", q), ("k", k)):
            layouts.check_divisible(arg, x.shape[2], world, layout, local=True)
        window = _validate_window(window, q.shape[2] * world, k.shape[2] * world)
    left, right = (None, None) if window is None else window
    o, lse = ring_attention_forward_op(
        q, k, v, bool(causal), float(default_scale(q, scale)), left, right, float(softcap), name, layout, key
    )
    return (o, lse) if return_lse else o
