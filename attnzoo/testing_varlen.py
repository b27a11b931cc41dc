"""Packed variable-length inputs and the float64 oracle's verdict on a backend's packed outputs (what the varlen
tests, ``compare --varlen`` and the varlen benchmark share).

The oracle of a packed batch is the dense oracle (:mod:`attnzoo.oracle`) run on each sequence alone, its results
packed the way ``attnzoo.attention_varlen`` returns them; SPEC.md's error rule is then applied to each packed output
as a whole, as :class:`attnzoo.testing.Oracle` does for a dense batch.

>>> x = random_varlen_inputs([300, 0, 17], [300, 5, 40], heads=4, kv_heads=2, head_dim=64, dtype=torch.float16)
>>> outputs, checks = check_varlen_backend(attnzoo.get("torch_fa2"), x, causal=True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import oracle
from .backend import Backend
from .testing import AttentionInputs, check_outputs
from .varlen import run_varlen_backward, run_varlen_forward, validate_varlen

Tensor = torch.Tensor
# Memory layouts of the packed inputs, all seen as [total, heads, d]: "contiguous"; "padded", a slice of rows 8
# elements wider; "heads-major", [heads, total, d] memory transposed (the row stride is d, the head stride total * d).
VARLEN_LAYOUTS = ("contiguous", "padded", "heads-major")


def cu_seqlens(lengths: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """int32 ``[B + 1]`` offsets of sequences of ``lengths``: ``0, l0, l0 + l1, ...``."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + int(length))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class VarlenInputs:
    """One packed call's tensors: q ``[total_q, H, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, Dv]``, do
    ``[total_q, H, Dv]`` (None: no backward), the int32 offsets, ALiBi slopes float32 ``[H]`` or ``[B, H]`` or None,
    and the lengths the offsets describe."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor | None
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    alibi_slopes: Tensor | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths_q)

    def rows(self, b: int) -> tuple[slice, slice]:
        """The query rows and the key rows of sequence ``b``."""
        q0, k0 = sum(self.lengths_q[:b]), sum(self.lengths_k[:b])
        return slice(q0, q0 + self.lengths_q[b]), slice(k0, k0 + self.lengths_k[b])

    def sequence(self, b: int) -> AttentionInputs:
        """Sequence ``b`` alone as dense inputs ``[1, H, n, D]`` (views of the packed tensors)."""
        rows_q, rows_k = self.rows(b)

        def dense(x: Tensor | None, rows: slice) -> Tensor | None:
            return None if x is None else x[rows].transpose(0, 1).unsqueeze(0)

        slopes = self.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b : b + 1]
        return AttentionInputs(
            dense(self.q, rows_q), dense(self.k, rows_k), dense(self.v, rows_k), dense(self.do, rows_q), None, slopes
        )

    def call_kwargs(self) -> dict[str, Any]:
        """The tensors of a packed call besides q, k, v (``cu_seqlens_*``, ``alibi_slopes``)."""
        return dict(cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=self.cu_seqlens_k, alibi_slopes=self.alibi_slopes)


def random_varlen_inputs(
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    head_dim_v: int | None = None,
    alibi: str = "none",
    layout: str = "contiguous",
    with_do: bool = True,
) -> VarlenInputs:
    """Fresh standard-normal packed q, k, v, do (never zeros) for sequences of ``lengths_q`` query rows and
    ``lengths_k`` keys, drawn from a generator of ``device`` seeded with ``seed`` and laid out as ``layout`` (one of
    :data:`VARLEN_LAYOUTS`).  ``alibi``: "none", "heads" or "batch-heads", slopes in [-0.2, 1) as
    :func:`attnzoo.testing.random_inputs` draws them."""
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"lengths_q and lengths_k must have one length per sequence, got {lengths_q}, {lengths_k}")
    if layout not in VARLEN_LAYOUTS:
        raise ValueError(f"layout must be one of {VARLEN_LAYOUTS}, got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(rows: int, heads_: int, d: int) -> Tensor:
        randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype, device=device)  # noqa: E731
        if layout == "padded":
            return randn(rows, heads_, d + 8)[..., 3 : 3 + d]
        if layout == "heads-major":
            return randn(heads_, rows, d).transpose(0, 1)
        return randn(rows, heads_, d)

    total_q, total_k = sum(lengths_q), sum(lengths_k)
    dv = head_dim if head_dim_v is None else head_dim_v
    q, k, v = draw(total_q, heads, head_dim), draw(total_k, kv_heads, head_dim), draw(total_k, kv_heads, dv)
    do = draw(total_q, heads, dv) if with_do else None
    slopes = None
    if alibi != "none":
        if alibi not in ("heads", "batch-heads"):
            raise ValueError(f"alibi must be 'none', 'heads' or 'batch-heads', got {alibi!r}")
        shape = (heads,) if alibi == "heads" else (len(lengths_q), heads)
        slopes = torch.rand(shape, generator=gen, dtype=torch.float32, device=device) * 1.2 - 0.2
    return VarlenInputs(
        q, k, v, do, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device), tuple(lengths_q),
        tuple(lengths_k), slopes,
    )  # fmt: skip


def _packed(results: list[oracle.Result | None], x: VarlenInputs, device: torch.device | str) -> oracle.Result:
    """Per-sequence dense results (None for a sequence without query rows) packed as the varlen call returns them."""
    H, Hkv = x.q.shape[1], x.k.shape[1]
    D, Dv = x.q.shape[2], x.v.shape[2]
    wide = x.q.dtype == torch.float64
    f64 = dict(dtype=torch.float64, device=device)
    packed = oracle.Result(
        o=torch.zeros(x.q.shape[0], H, Dv, **f64),
        lse=torch.zeros(H, x.q.shape[0], dtype=torch.float64 if wide else torch.float32, device=device),
    )
    if x.do is not None:
        packed.dq = torch.zeros(x.q.shape[0], H, D, **f64)
        packed.dk, packed.dv = torch.zeros(x.k.shape[0], Hkv, D, **f64), torch.zeros(x.k.shape[0], Hkv, Dv, **f64)
    for b, result in enumerate(results):
        if result is None:
            continue
        rows_q, rows_k = x.rows(b)
        packed.o[rows_q] = result.o[0].transpose(0, 1).double()
        packed.lse[:, rows_q] = result.lse[0]
        if x.do is not None:
            packed.dq[rows_q] = result.dq[0].transpose(0, 1).double()
            packed.dk[rows_k] = result.dk[0].transpose(0, 1).double()
            packed.dv[rows_k] = result.dv[0].transpose(0, 1).double()
    return packed


@dataclass
class VarlenOracle:
    """The float64 oracle on each sequence of a packed batch (``exact``, packed) and plain PyTorch's results in the
    input dtype (``baseline``, where SPEC.md's rule takes one): the judge of a backend's packed outputs."""

    inputs: VarlenInputs
    causal: bool
    scale: float | None
    window: tuple[int | None, int | None] | None
    softcap: float
    exact: oracle.Result
    baseline: oracle.Result | None
    per_sequence: list[oracle.Result | None]

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the judged packed call besides q, k, v (and the tensors of ``inputs``)."""
        return dict(causal=self.causal, scale=self.scale, window=self.window, softcap=self.softcap)

    def check(self, outputs: Mapping[str, Any], stored_o: Tensor | None = None) -> dict[str, oracle.Check]:
        """Each of ``outputs`` ("o", "lse", "dq", "dk", "dv": those given, packed) against the oracle under SPEC.md's
        rule; the gradients with Delta from ``stored_o`` (default ``outputs["o"]``), the ``o`` the backward had."""
        x = self.inputs
        stored_o = outputs.get("o") if stored_o is None else stored_o
        contract: dict[str, float] = {}
        if x.do is not None and any(name in outputs for name in ("dq", "dk", "dv")):
            for b, exact in enumerate(self.per_sequence):
                if exact is None or x.lengths_k[b] == 0:  # no key: every gradient is exactly 0, whatever Delta
                    continue
                seq = x.sequence(b)
                own_o = None if stored_o is None else stored_o[x.rows(b)[0]].transpose(0, 1).unsqueeze(0)
                errors = oracle.contract_errors(
                    seq.q, seq.k, seq.v, seq.do, exact, self.causal, self.scale, None, own_o, self.window,
                    self.softcap, seq.alibi_slopes,
                )  # fmt: skip
                for name, error in errors.items():
                    contract[name] = max(contract.get(name, 0.0), error)
        return check_outputs(outputs, self.exact, self.baseline, x.q.dtype, contract)


def varlen_oracle_for(
    inputs: VarlenInputs,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    device: torch.device | str = "cpu",
) -> VarlenOracle:
    """Run the oracle (and plain PyTorch where SPEC.md's rule needs it) on every sequence of ``inputs`` alone."""
    x = inputs
    wants_baseline = x.q.dtype in oracle.LOW_PRECISION or (x.q.dtype == torch.float32 and bool(softcap))
    exact, baseline = [], []
    for b in range(x.batch):
        if x.lengths_q[b] == 0:  # no query row: no output, and its keys get zero gradients
            exact.append(None)
            baseline.append(None)
            continue
        seq = x.sequence(b)
        args = (seq.q, seq.k, seq.v, seq.do, causal, scale, None)
        modifiers = dict(window=window, softcap=softcap, alibi_slopes=seq.alibi_slopes)
        exact.append(oracle.reference(*args, device=device, **modifiers))
        baseline.append(oracle.plain_torch(*args, **modifiers) if wants_baseline else None)
    packed_baseline = _packed(baseline, x, device) if wants_baseline else None
    return VarlenOracle(x, causal, scale, window, softcap, _packed(exact, x, device), packed_baseline, exact)


def run_varlen_backend(
    backend: Backend,
    inputs: VarlenInputs,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
) -> dict[str, Any]:
    """``backend``'s packed forward on ``inputs`` (and its packed backward on the forward's ``o`` and ``lse`` when
    ``inputs.do`` is given), validated as ``attention_varlen`` validates: ``{"o", "lse"[, "dq", "dk", "dv"]}``."""
    x = inputs
    problem = validate_varlen(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, None, None, causal, scale, window, softcap, x.alibi_slopes
    )
    o, lse = run_varlen_forward(backend, x.q, x.k, x.v, problem)
    outputs = {"o": o, "lse": lse}
    if x.do is not None:
        outputs["dq"], outputs["dk"], outputs["dv"] = run_varlen_backward(backend, x.do, x.q, x.k, x.v, o, lse, problem)
    return outputs


def check_varlen_backend(
    backend: Backend,
    inputs: VarlenInputs,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float = 0.0,
    judge: VarlenOracle | None = None,
) -> tuple[dict[str, Any], dict[str, oracle.Check]]:
    """Run ``backend`` on packed ``inputs`` and check every output against the oracle (``judge``, or one run here
    on the CPU); returns the outputs and the per-output checks."""
    outputs = run_varlen_backend(backend, inputs, causal, scale, window, softcap)
    if judge is None:
        judge = varlen_oracle_for(inputs, causal, scale, window=window, softcap=softcap)
    return outputs, judge.check(outputs)
