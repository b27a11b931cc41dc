"""Random attention inputs and the float64 oracle's verdict on a backend's outputs: what the tests, ``compare`` and
``bench`` share.

>>> x = random_inputs(2, 8, 2, 256, 256, 64, dtype=torch.float16, device="cuda", seed=0, seqlens_k=[256, 100])
>>> outputs, checks = check_backend(attnzoo.get("triton_2kernel"), x, causal=True)
>>> all(check.ok for check in checks.values())       # SPEC.md's error rule, per output
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import oracle
from .backend import Backend

Tensor = torch.Tensor
OUTPUTS = ("o", "lse", "dq", "dk", "dv")
# Memory layouts of the inputs, all seen as [B, H, N, D]: "contiguous"; "bnhd", [B, N, H, D] memory transposed;
# "padded", a slice of rows 8 elements wider that the kernels must not read past; "broadcast", one head expanded
# over all heads (head stride 0).
LAYOUTS = ("contiguous", "bnhd", "padded", "broadcast")


@dataclass(frozen=True)
class AttentionInputs:
    """One call's tensors: q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]``, do ``[B, H, Nq, Dv]``
    (None when no backward is wanted), seqlens_k int32 ``[B]`` or None, alibi_slopes float32 ``[H]`` or ``[B, H]``
    or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor | None
    seqlens_k: Tensor | None
    alibi_slopes: Tensor | None = None


def random_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    seqlens_k: Sequence[int] | None = None,
    layout: str = "contiguous",
    with_do: bool = True,
    head_dim_v: int | None = None,
    alibi: str = "none",
) -> AttentionInputs:
    """Fresh standard-normal q, k, v and do (never zeros) in ``dtype`` on ``device``, drawn from a generator of that
    device seeded with ``seed`` and laid out as ``layout`` (one of :data:`LAYOUTS`); ``seqlens_k`` becomes an int32
    tensor ``[B]`` on the device.  ``head_dim_v``: v's and do's head dim (default ``head_dim``).  ``alibi``: "none",
    "heads" (slopes ``[H]``) or "batch-heads" (``[B, H]``), float32 slopes drawn in [-0.2, 1) (mostly a penalty with
    distance, as in BLOOM; any real slope is valid)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype, device=device)

    def draw(heads_: int, n: int, d: int) -> Tensor:
        if layout == "bnhd":
            return randn(batch, n, heads_, d).transpose(1, 2)
        if layout == "padded":
            return randn(batch, heads_, n, d + 8)[..., 3 : 3 + d]
        if layout == "broadcast":
            return randn(batch, 1, n, d).expand(batch, heads_, n, d)
        return randn(batch, heads_, n, d)

    dv = head_dim if head_dim_v is None else head_dim_v
    q, k, v = draw(heads, seqlen_q, head_dim), draw(kv_heads, seqlen_k, head_dim), draw(kv_heads, seqlen_k, dv)
    do = draw(heads, seqlen_q, dv) if with_do else None
    lengths = None if seqlens_k is None else torch.tensor(list(seqlens_k), dtype=torch.int32, device=device)
    slopes = None
    if alibi != "none":
        if alibi not in ("heads", "batch-heads"):
            raise ValueError(f"alibi must be 'none', 'heads' or 'batch-heads', got {alibi!r}")
        shape = (heads,) if alibi == "heads" else (batch, heads)
        slopes = torch.rand(shape, generator=gen, dtype=torch.float32, device=device) * 1.2 - 0.2
    return AttentionInputs(q, k, v, do, lengths, slopes)


@dataclass
class Oracle:
    """The float64 oracle's results on one input (``exact``) and plain PyTorch's in the input dtype (``baseline``,
    float16/bfloat16 only): the judge of every backend's outputs on that input (SPEC.md, "The test oracle")."""

    inputs: AttentionInputs
    causal: bool
    scale: float | None
    exact: oracle.Result
    baseline: oracle.Result | None
    chunked: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float = 0.0

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the judged call besides the tensors (``forward``, ``backward``, the oracle)."""
        x = self.inputs
        return dict(
            causal=self.causal, scale=self.scale, seqlens_k=x.seqlens_k, window=self.window, softcap=self.softcap,
            alibi_slopes=x.alibi_slopes,
        )  # fmt: skip

    def check(self, outputs: Mapping[str, Any], stored_o: Any = None) -> dict[str, oracle.Check]:
        """Each of ``outputs`` ("o", "lse", "dq", "dk", "dv": those given) against the oracle under SPEC.md's rule.

        The gradients are judged with the error the contract brings (Delta from the stored ``o``): ``stored_o`` is
        the ``o`` the backward was handed, by default ``outputs["o"]``.
        """
        x, kw = self.inputs, self.call_kwargs
        stored_o = outputs.get("o") if stored_o is None else stored_o
        contract: dict[str, float] = {}
        if x.do is not None and any(name in outputs for name in ("dq", "dk", "dv")):
            contract = oracle.contract_errors(
                x.q, x.k, x.v, x.do, self.exact, **kw, stored_o=stored_o, chunked=self.chunked
            )
        return check_outputs(outputs, self.exact, self.baseline, x.q.dtype, contract)


def check_outputs(
    outputs: Mapping[str, Any],
    exact: oracle.Result,
    baseline: oracle.Result | None,
    dtype: torch.dtype,
    contract: Mapping[str, float],
) -> dict[str, oracle.Check]:
    """Each of ``outputs`` (those of :data:`OUTPUTS` given) against the oracle's ``exact`` under SPEC.md's rule, with
    plain PyTorch's ``baseline`` and the ``contract`` errors of the gradients (``oracle.contract_errors``)."""
    checks = {}
    for name in OUTPUTS:
        if name in outputs:
            base = None if baseline is None else getattr(baseline, name)
            checks[name] = oracle.check_output(
                name, outputs[name], getattr(exact, name), base, dtype, contract.get(name, 0.0)
            )
    return checks


def oracle_for(
    inputs: AttentionInputs,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    device: torch.device | str = "cpu",
    chunked: bool = False,
) -> Oracle:
    """Run the oracle on ``inputs`` (gradients too when ``inputs.do`` is given) on ``device``, with the score
    modifiers ``window``, ``softcap`` and ``inputs.alibi_slopes``.

    ``chunked``: one (batch, query head) at a time (:func:`attnzoo.oracle.reference_chunked`), for sequences whose
    whole score matrix would not fit; the verdicts are the same.
    """
    x = inputs
    args = (x.q, x.k, x.v, x.do, causal, scale, x.seqlens_k)
    modifiers = dict(window=window, softcap=softcap, alibi_slopes=x.alibi_slopes)
    # The baseline of SPEC.md's rule: float16/bfloat16 always; float32 only with a soft cap, which makes the backward
    # ill-conditioned (oracle.bound).
    wants_baseline = x.q.dtype in oracle.LOW_PRECISION or (x.q.dtype == torch.float32 and bool(softcap))
    if chunked:
        exact = oracle.reference_chunked(*args, device=device, **modifiers)
        baseline = oracle.plain_torch_chunked(*args, **modifiers) if wants_baseline else None
    else:
        exact = oracle.reference(*args, device=device, **modifiers)
        baseline = oracle.plain_torch(*args, **modifiers) if wants_baseline else None
    return Oracle(x, causal, scale, exact, baseline, chunked, window, softcap)


def run_backend(
    backend: Backend,
    inputs: AttentionInputs,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
) -> dict[str, Any]:
    """``backend``'s forward on ``inputs`` (with ``window``, ``softcap`` and ``inputs.alibi_slopes``), and its
    backward on the forward's ``o`` and ``lse`` when ``inputs.do`` is given: ``{"o", "lse"[, "dq", "dk", "dv"]}``."""
    x = inputs
    kw = dict(
        causal=causal, scale=scale, seqlens_k=x.seqlens_k, window=window, softcap=softcap, alibi_slopes=x.alibi_slopes
    )
    o, lse = backend.forward(x.q, x.k, x.v, **kw)
    outputs = {"o": o, "lse": lse}
    if x.do is not None:
        outputs["dq"], outputs["dk"], outputs["dv"] = backend.backward(x.do, x.q, x.k, x.v, o, lse, **kw)
    return outputs


def check_backend(
    backend: Backend,
    inputs: AttentionInputs,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    judge: Oracle | None = None,
    chunked: bool = False,
) -> tuple[dict[str, Any], dict[str, oracle.Check]]:
    """Run ``backend`` on ``inputs`` (:func:`run_backend`) and check every output against the oracle; returns the
    outputs and the per-output checks.  ``judge``: an :class:`Oracle` already run on these inputs, else one is run
    (on the inputs' device when ``chunked``, else on the CPU)."""
    outputs = run_backend(backend, inputs, causal, scale, window, softcap)
    if judge is None:
        device = inputs.q.device if chunked else "cpu"
        judge = oracle_for(inputs, causal, scale, window=window, softcap=softcap, device=device, chunked=chunked)
    return outputs, judge.check(outputs)
