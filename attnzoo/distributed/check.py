"""Ring attention against the float64 oracle on random cases: each rank shards the same whole inputs, runs
``ring_attention`` forward and backward, and the unsharded ``o``, ``lse``, ``dq``, ``dk``, ``dv`` are judged on rank 0
by SPEC.md's error rule (the rule every single-process backend is held to).

Under ``torchrun`` (NCCL on GPUs, gloo on CPUs)::

    torchrun --nproc-per-node=2 -m attnzoo.distributed.check --cases 20 --backends torch_fa2,triton_2kernel

The tests spawn gloo processes through :func:`spawned` (on the CPU, and on one GPU shared by every rank).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import testing
from ..autograd import attention
from . import attention as ring
from .layout import LAYOUTS, chunks_per_rank

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DTYPES = {"float64": F64, "float32": F32, "float16": F16, "bfloat16": BF16}


@dataclass(frozen=True)
class RingCase:
    """One ring attention call on the whole problem ``q [B, H, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B, Hkv, Nk, Dv]``
    (``Nq``, ``Nk`` split by ``layout`` over the ranks); ``bnhd``: inputs laid out ``[B, N, H, D]`` in memory."""

    layout: str
    backend: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float
    scale: float | None
    dtype: torch.dtype
    seed: int
    bnhd: bool = False

    def __str__(self) -> str:
        return (
            f"{self.backend} {self.layout} {str(self.dtype).removeprefix('torch.')} B={self.batch} H={self.heads} "
            f"Hkv={self.kv_heads} Nq={self.seqlen_q} Nk={self.seqlen_k} D={self.head_dim} Dv={self.head_dim_v} "
            f"causal={self.causal} window={self.window} softcap={self.softcap} scale={self.scale} bnhd={self.bnhd} "
            f"seed={self.seed}"
        )


def random_cases(
    rng: random.Random,
    world: int,
    count: int,
    backends: Sequence[str],
    dtypes: Sequence[torch.dtype],
    max_chunk: int = 6,
    head_dims: Sequence[int] = (8, 16, 24, 40),
) -> list[RingCase]:
    """``count`` random cases for ``world`` ranks: chunks of 1 to ``max_chunk`` rows (so sequences of ``W`` to
    ``2W max_chunk``), Nq = Nk or not, GQA/MQA, causal or not, windows of any sign (one-sided, empty, wider than N),
    soft caps, scales of either sign, Dv != D, a strided memory layout; backends and dtypes taken in turn, so that
    each appears."""
    cases = []
    for i in range(count):
        layout = LAYOUTS[i % len(LAYOUTS)] if world > 1 else "contiguous"
        chunks = chunks_per_rank(layout) * world
        seqlen_q = chunks * rng.randint(1, max_chunk)
        seqlen_k = seqlen_q if rng.random() < 0.6 else chunks * rng.randint(1, max_chunk)
        kv_heads = rng.randint(1, 2)
        head_dim = rng.choice(head_dims)
        window = None
        if rng.random() < 0.5:

            def side(n: int = seqlen_k) -> int | None:
                return rng.choice([None, 0, 1, -1, n, n + 3, -n, rng.randint(-n, n)])

            window = (side(), side())
        cases.append(
            RingCase(
                layout=layout,
                backend=backends[i % len(backends)],
                batch=rng.randint(1, 2),
                heads=kv_heads * rng.choice([1, 2, 3]),
                kv_heads=kv_heads,
                seqlen_q=seqlen_q,
                seqlen_k=seqlen_k,
                head_dim=head_dim,
                head_dim_v=head_dim if rng.random() < 0.7 else rng.choice(head_dims),
                causal=rng.random() < 0.5,
                window=window,
                softcap=0.0 if rng.random() < 0.6 else rng.choice([0.5, 5.0, 30.0]),
                scale=rng.choice([None, None, 0.3, -0.5, 1.2]),
                dtype=dtypes[(i // len(backends)) % len(dtypes)],
                seed=rng.randrange(2**31),
                bnhd=rng.random() < 0.25,
            )
        )
    return cases


def run_case(case: RingCase, device: torch.device | str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Run ``case`` on this rank (every rank of ``group`` runs it); on rank 0 return the failures ([] when every
    output is within SPEC.md's bound), elsewhere []."""
    x = testing.random_inputs(
        case.batch, case.heads, case.kv_heads, case.seqlen_q, case.seqlen_k, case.head_dim, dtype=case.dtype,
        device=device, seed=case.seed, layout="bnhd" if case.bnhd else "contiguous", head_dim_v=case.head_dim_v,
    )  # fmt: skip
    before = [t.clone() for t in (x.q, x.k, x.v)]
    local = [ring.shard(t, group, case.layout).detach().requires_grad_() for t in (x.q, x.k, x.v)]
    o, lse = ring.ring_attention(
        *local, case.causal, case.scale, group, case.layout, case.backend, window=case.window,
        softcap=case.softcap, return_lse=True,
    )  # fmt: skip
    o.backward(ring.shard(x.do, group, case.layout))
    outputs = {name: ring.unshard(t.detach(), group, case.layout) for name, t in (("o", o), ("lse", lse))}
    for name, t in zip(("dq", "dk", "dv"), local, strict=True):
        outputs[name] = ring.unshard(t.grad, group, case.layout)
    if dist.get_rank(group) != 0:
        return []
    failures = [f"input {n} was modified" for n, a, b in zip("qkv", (x.q, x.k, x.v), before, strict=True) if not
                torch.equal(a, b)]  # fmt: skip
    cpu = testing.AttentionInputs(*(None if t is None else t.cpu() for t in (x.q, x.k, x.v, x.do, None, None)))
    judge = testing.oracle_for(cpu, case.causal, case.scale, window=case.window, softcap=case.softcap)
    for name, check in judge.check({name: t.cpu() for name, t in outputs.items()}).items():
        if not check.ok:
            failures.append(f"{name}: {check.message}")
    return [f"{case}: {failure}" for failure in failures]


def check_compiled(device: torch.device | str, group: dist.ProcessGroup | None = None, backend: str = "torch_fa2"):
    """``ring_attention`` with a little arithmetic around it under ``torch.compile(fullgraph=True)`` (aot_eager:
    Dynamo and AOTAutograd, no code generation): one graph, no break, and the eager values and gradients."""

    def step(q, k, v):
        return ring.ring_attention(q * 1.5, k, v, True, None, group, "zigzag", backend, window=(5, 1)).sin()

    world = dist.get_world_size(group)
    gen = torch.Generator(device=device).manual_seed(7)
    whole = [torch.randn(2, 2, 4 * world, 16, generator=gen, device=device) for _ in range(3)]
    local = [ring.shard(t, group, "zigzag") for t in whole]
    explained = torch._dynamo.explain(step)(*local)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in local]
        out = fn(*leaves)
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(("o", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)
    # Through unshard's autograd as well: the whole output's gradient reaches each rank's inputs.
    leaves = [t.detach().clone().requires_grad_() for t in local]
    ring.unshard(step(*leaves), group, "zigzag").square().sum().backward()
    expected = [t.detach().clone().requires_grad_() for t in whole]
    attention(
        expected[0] * 1.5, *expected[1:], causal=True, window=(5, 1), backend=backend
    ).sin().square().sum().backward()
    for name, got, want in zip(("dq", "dk", "dv"), leaves, expected, strict=True):
        torch.testing.assert_close(got.grad, ring.shard(want.grad, group, "zigzag"), atol=1e-5, rtol=1e-5, msg=name)


def spawned(
    rank: int,
    world: int,
    init_method: str,
    cases: Sequence[RingCase],
    device: str,
    with_compile: bool = False,
) -> None:
    """A ``torch.multiprocessing.spawn`` worker: joins a gloo group of ``world`` processes, runs ``cases`` on
    ``device`` (every rank on the same one), and raises on rank 0 with every failure listed."""
    torch.set_num_threads(1)  # several ranks share the machine's cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        failures = []
        for case in cases:
            failures.extend(run_case(case, device))
        if with_compile:
            check_compiled(device)
        if failures:
            raise AssertionError(f"{len(failures)} of the ring attention outputs out of bound:\n" + "\n".join(failures))
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnzoo.distributed.check", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=20, help="random cases (default 20)")
    parser.add_argument("--backends", default="auto", help="comma-separated local backends (default auto)")
    parser.add_argument("--dtypes", default="float32,float16", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--max-chunk", type=int, default=64, help="rows per chunk at most (default 64)")
    parser.add_argument("--seed", type=int, default=None, help="the cases' seed (default: drawn and printed)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    box = [seed]
    dist.broadcast_object_list(box, src=0)
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    cases = random_cases(random.Random(box[0]), dist.get_world_size(), args.cases, args.backends.split(","), dtypes,
                         max_chunk=args.max_chunk, head_dims=(32, 64, 128))  # fmt: skip
    failures = []
    for case in cases:
        failures.extend(run_case(case, "cuda" if cuda else "cpu"))
    if dist.get_rank() == 0:
        print(f"seed {box[0]}: {len(cases)} cases on {dist.get_world_size()} ranks, {len(failures)} failures")
        for failure in failures:
            print(failure)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
