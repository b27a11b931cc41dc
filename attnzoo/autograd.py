"""``attnzoo.attention``: exact attention with autograd, as PyTorch custom operators.

Traced and compiled calls reach the backends through two operators of the ``attnzoo`` namespace:

- ``attnzoo::attention_forward(q, k, v, seqlens_k, causal, scale, backend) -> (o, lse)``
- ``attnzoo::attention_backward(do, q, k, v, o, lse, seqlens_k, causal, scale, backend) -> (dq, dk, dv)``

registered with ``torch.library.custom_op``, a fake (meta) implementation that gives shapes and dtypes only, and an
autograd formula that calls the backward operator.  ``torch.compile`` therefore sees each kernel call as one opaque
node: Dynamo never traces into the Triton launch code (whose pointer arithmetic and tuning it cannot follow), Inductor
never recompiles the kernels, and the graph has no break.  Under CUDA graph capture the operators launch the kernels
as in eager mode.

Plain eager calls (real tensors; no dispatch or function mode, functorch transform or jit trace) make the same two
backend calls through a ``torch.autograd.Function`` instead (``_EagerAttention``): at small shapes the operators'
dispatch and autograd wrappers cost nearly as much host time as the two calls themselves.  Eager calls therefore
reach nothing keyed on the operators (a kernel registered for ``attnzoo::attention_forward``, the profiler's operator
events).

The first call of a custom operator imports ``torch._dynamo`` (its dispatch is wrapped in ``torch._disable_dynamo``),
3-4 s of imports on the H100 machine; it is imported with this module instead, so that the cost is paid once at
``import attnzoo`` and not inside the first attention call.

``backend`` travels as a string: a registered name, ``"auto"`` (resolved inside the operator, where the tensors are
real, so that a traced graph does not depend on the pick), or the key of a backend instance built with options
(``attnzoo.get(name, **options)``), registered here on first use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo  # imported here, not by the first call: see above
from torch._C._functorch import is_functorch_wrapped_tensor

from .backend import Backend, get, names
from .validation import Problem, lse_dtype, validate_forward

Tensor = torch.Tensor


def pick_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Backend:
    """The preferred backend (lowest ``auto_rank`` on the device type) that supports these inputs."""
    return _pick(validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes))


def pick_ranked(
    device: str, rank_table: Callable[[Backend], dict], reasons: Callable[[Backend], list[str]], refusal: str
) -> Backend:
    """The registered backend of lowest rank on ``device`` (``rank_table(backend)``: device type -> rank; absent:
    never picked) whose ``reasons(backend)`` are empty; ``NotImplementedError`` starting with ``refusal`` and listing
    every backend's reasons when none qualifies."""
    candidates = []
    for name in names():
        backend = get(name)
        rank = rank_table(backend).get(device)
        if rank is not None and not reasons(backend):
            candidates.append((rank, name))
    if not candidates:
        raise NotImplementedError(f"{refusal}: " + "; ".join(f"{n}: {', '.join(reasons(get(n)))}" for n in names()))
    return get(min(candidates)[1])


def _pick(problem: Problem) -> Backend:
    return pick_ranked(
        problem.device,
        lambda backend: backend.capabilities.auto_rank,
        lambda backend: backend.reasons_for(problem),
        "no registered backend supports these inputs",
    )


# -- backends by key ------------------------------------------------------------------------------------------------
# Custom operators take strings, not objects: a backend that is not the registered instance of its name (a variant
# with options) is kept here under a key that names it.
_INSTANCES: dict[str, Backend] = {}


def backend_key(backend: str | Backend) -> str:
    """The string that names ``backend`` in an operator call: its name, ``"auto"``, or a key of an unregistered
    instance (which is remembered here)."""
    if isinstance(backend, str):
        if backend != "auto":
            get(backend)  # an unknown name fails here, listing the known ones
        return backend
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a backend name, a Backend or 'auto', got {type(backend).__name__}")
    if backend.name in names() and get(backend.name) is backend:
        return backend.name
    key = f"{backend.name}@{id(backend):x}"
    _INSTANCES[key] = backend
    return key


def _backend_of(key: str, problem: Problem) -> Backend:
    if key == "auto":
        return _pick(problem)
    instance = _INSTANCES.get(key)
    return instance if instance is not None else get(key)


def _problem(q, k, v, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes) -> Problem:
    """Shapes and arguments checked inside an operator.  The values of ``seqlens_k`` are not read here: that would
    synchronise with the GPU on every call of a compiled graph; :func:`attention` checks them in eager mode.
    The window travels as its two sides (an operator's schema has no optional pairs); both None is no window."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes, check_values=False)


# -- the operators --------------------------------------------------------------------------------------------------
@torch.library.custom_op("attnzoo::attention_forward", mutates_args=())
def attention_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens_k: Tensor | None,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``o`` ``[B, H, Nq, Dv]`` (dtype of q) and ``lse`` ``[B, H, Nq]`` (float32; float64 for float64 inputs)."""
    problem = _problem(q, k, v, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes)
    return _backend_of(backend, problem).forward_validated(q, k, v, problem)


@attention_forward_op.register_fake
def _(q, k, v, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes, backend):
    B, H, Nq, _ = q.shape
    o = q.new_empty((B, H, Nq, v.shape[-1]))
    lse = q.new_empty((B, H, Nq), dtype=lse_dtype(q.dtype))
    return o, lse


@torch.library.custom_op("attnzoo::attention_backward", mutates_args=())
def attention_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    seqlens_k: Tensor | None,
    causal: bool,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq`` (shape of q) and ``dk``, ``dv`` (shape of k, v; summed over each query-head group)."""
    problem = _problem(q, k, v, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes)
    return _backend_of(backend, problem).backward_validated(do, q, k, v, o, lse, problem)


@attention_backward_op.register_fake
def _(do, q, k, v, o, lse, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seqlens_k, alibi_slopes)
    ctx.arguments = (causal, scale, window_left, window_right, softcap)
    ctx.backend = backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seqlens_k, alibi_slopes = ctx.saved_tensors
    causal, scale, window_left, window_right, softcap = ctx.arguments
    dq, dk, dv = attention_backward_op(
        do, q, k, v, o, lse, seqlens_k, causal, scale, window_left, window_right, softcap, alibi_slopes, ctx.backend
    )
    # seqlens_k and the ALiBi slopes get no gradient (nor do the non-tensor arguments).
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


def default_scale(q: Tensor, scale: float | None) -> float:
    """``scale``, or ``1/sqrt(D)`` when None (as SDPA)."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    seqlens_k: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    backend: str | Backend = "auto",
) -> Tensor:
    """Exact attention with autograd.

    q: ``[B, H, Nq, D]``; k: ``[B, Hkv, Nk, D]``, v: ``[B, Hkv, Nk, Dv]`` with ``H % Hkv == 0``; seqlens_k: integer
    ``[B]`` or None; window, softcap, alibi_slopes: SPEC.md's score modifiers (the slopes get no gradient).
    Returns o: ``[B, H, Nq, Dv]`` in the dtype of q.  ``causal`` is aligned to the bottom-right corner (as
    FlashAttention; :func:`attnzoo.sdpa` has SDPA's top-left ``is_causal``).  ``backend`` is a registered name, a
    :class:`Backend`, or ``"auto"``.  Works inside ``torch.compile(fullgraph=True)`` and CUDA graph capture.
    """
    key = backend_key(backend)
    if not torch.compiler.is_compiling():
        # Eager: every check before any kernel, the values of seqlens_k included unless a CUDA graph is being
        # captured (reading them would synchronise with the GPU, which capture forbids).  Traced: the operators check
        # shapes when they run; reading seqlens_k's values there would cost a synchronisation per call.
        capturing = isinstance(q, Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()
        validate_forward(q, k, v, causal, scale, seqlens_k, window, softcap, alibi_slopes, check_values=not capturing)
    if seqlens_k is not None and seqlens_k.dtype != torch.int32:
        seqlens_k = seqlens_k.to(torch.int32)
    left, right = (None, None) if window is None else window
    arguments = (seqlens_k, bool(causal), float(default_scale(q, scale)), left, right, float(softcap), alibi_slopes)
    if not torch.compiler.is_compiling() and _plain_eager(q, k, v, seqlens_k, alibi_slopes):
        problem = _problem(q, k, v, *arguments)
        backend_instance = _backend_of(key, problem)
        inputs = (q, k, v) if alibi_slopes is None else (q, k, v, alibi_slopes)
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
            return backend_instance.forward_validated(q, k, v, problem)[0]  # nothing to differentiate: no graph node
        o, _lse = _EagerAttention.apply(q, k, v, seqlens_k, alibi_slopes, problem, backend_instance, arguments, key)
        return o
    o, _lse = attention_forward_op(q, k, v, *arguments, key)
    return o


def _plain_eager(*tensors: Tensor | None) -> bool:
    """Whether a call may take ``_EagerAttention``: no dispatch or function mode (fake tensors' mode, a FLOP counter),
    functorch transform or ``torch.jit.trace`` is active, and every tensor is a plain one (not a subclass such as a
    fake tensor or a DTensor, nor wrapped by a functorch transform); the operators serve the others, whose fake
    implementations, schemas and single graph node these need."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None:
        return False
    return all(t is None or (type(t) is Tensor and not is_functorch_wrapped_tensor(t)) for t in tensors)


class _EagerAttention(torch.autograd.Function):
    """``attention()`` in plain eager mode: the operators' two backend calls, without their dispatch and autograd
    wrappers, which took 0.73 ms of a 1.54 ms training step's host time on the H100 machine (tiny shapes,
    ``bench/results/h100_step_host_gaps.log``).  Compiled graphs, fake tensors and the rest of ``_plain_eager``'s
    exceptions go through the operators, which call the backend the same way."""

    @staticmethod
    def forward(ctx, q, k, v, seqlens_k, alibi_slopes, problem: Problem, backend: Backend, arguments: tuple, key: str):
        o, lse = backend.forward_validated(q, k, v, problem)
        # seqlens_k and the slopes are saved as the operator saves them: modified in place before the backward, they
        # fail autograd's version check instead of changing the gradients.
        ctx.save_for_backward(q, k, v, o, lse, seqlens_k, alibi_slopes)
        ctx.problem, ctx.backend, ctx.arguments, ctx.key = problem, backend, arguments, key
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, seqlens_k, alibi_slopes = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the backward operator, which has no derivative and says so
            dq, dk, dv = attention_backward_op(
                do, q, k, v, o, lse, seqlens_k, *ctx.arguments[1:6], alibi_slopes, ctx.key
            )  # fmt: skip
        else:
            dq, dk, dv = ctx.backend.backward_validated(do, q, k, v, o, lse, ctx.problem)
        return dq, dk, dv, None, None, None, None, None, None
