"""Random KV-cache calls and their judge: what tests/test_kvcache.py (CPU) and tests/test_gpu_kvcache.py share.

The judge is the float64 oracle on each sequence's keys gathered densely (the cache after the append, keys
``0 .. cache_seqlens[b] + Nnew - 1``), so that bottom-right alignment to that length is the oracle's own alignment to
Nk; plain PyTorch in the input dtype on the same keys sets the low-precision error budget (SPEC.md's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import attnzoo
from attnzoo import oracle
from attnzoo.kvcache import gather_sequence

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class KVCase:
    """One KV-cache call.  ``page_size`` 0: a dense cache of ``capacity`` keys; else pages of that size,
    ``capacity // page_size`` per sequence, in a pool with ``spare_pages`` pages no sequence owns."""

    batch: int
    kv_heads: int
    group: int
    seqlen_q: int
    head_dim: int
    head_dim_v: int
    page_size: int
    capacity: int
    cache_seqlens: tuple[int, ...]
    new_keys: int
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float
    alibi: bool
    dtype: torch.dtype
    seed: int
    transposed: bool = False  # the cache as a [.., N or page_size, Hkv, D] buffer seen through .transpose(1, 2)
    spare_pages: int = 3

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def make(self, device: str = "cpu") -> dict:
        """Fresh random tensors: q, the caches (every slot random, never zeros, stale rows included), k_new, v_new,
        cache_seqlens, a block table of shuffled physical pages, ALiBi slopes."""
        gen = torch.Generator(device=device).manual_seed(self.seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, dtype=self.dtype, device=device)

        B, Hkv, D, Dv = self.batch, self.kv_heads, self.head_dim, self.head_dim_v
        table = None
        if self.page_size:
            pages_per_seq = self.capacity // self.page_size
            slots, inner = B * pages_per_seq + self.spare_pages, self.page_size
            order = torch.randperm(slots, generator=gen, device=device)[: B * pages_per_seq]
            table = order.view(B, pages_per_seq).to(torch.int32)
        else:
            slots, inner = B, self.capacity

        def cache(d):
            if self.transposed:
                return randn(slots, inner, Hkv, d).transpose(1, 2)
            return randn(slots, Hkv, inner, d)

        k_new = randn(B, Hkv, self.new_keys, D) if self.new_keys else None
        v_new = randn(B, Hkv, self.new_keys, Dv) if self.new_keys else None
        slopes = None
        if self.alibi:
            slopes = torch.rand(B, self.heads, generator=gen, dtype=torch.float32, device=device) * 1.2 - 0.2
        return dict(
            q=randn(B, self.heads, self.seqlen_q, D), k_cache=cache(D), v_cache=cache(Dv),
            cache_seqlens=torch.tensor(self.cache_seqlens, dtype=torch.int32, device=device), k_new=k_new,
            v_new=v_new, block_table=table, alibi_slopes=slopes,
        )  # fmt: skip

    def call(self, x: dict, backend) -> tuple[torch.Tensor, torch.Tensor]:
        return attnzoo.attention_with_kvcache(
            x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"],
            causal=self.causal, window=self.window, softcap=self.softcap, alibi_slopes=x["alibi_slopes"],
            backend=backend, return_lse=True,
        )  # fmt: skip


def expected_cache(x: dict, case: KVCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as the append must leave them: the inputs with exactly the new rows written."""
    k, v = x["k_cache"].clone(), x["v_cache"].clone()
    for b in range(case.batch):
        for j in range(case.new_keys):
            t = case.cache_seqlens[b] + j
            if case.page_size:
                page, slot = int(x["block_table"][b, t // case.page_size]), t % case.page_size
            else:
                page, slot = b, t
            k[page, :, slot] = x["k_new"][b, :, j]
            v[page, :, slot] = x["v_new"][b, :, j]
    return k, v


def judge(x: dict, case: KVCase, k_cache: torch.Tensor, v_cache: torch.Tensor, o, lse, device="cpu") -> None:
    """Assert ``o``, ``lse`` against the float64 oracle on each sequence's gathered keys (SPEC.md's rule)."""
    exact_o, exact_lse, base_o, base_lse = [], [], [], []
    for b in range(case.batch):
        length = case.cache_seqlens[b] + case.new_keys
        k_b = gather_sequence(k_cache, x["block_table"], b, length)
        v_b = gather_sequence(v_cache, x["block_table"], b, length)
        q_b = x["q"][b : b + 1]
        slopes = None if x["alibi_slopes"] is None else x["alibi_slopes"][b : b + 1]
        kw = dict(causal=case.causal, window=case.window, softcap=case.softcap, alibi_slopes=slopes)
        exact = oracle.reference(q_b, k_b, v_b, device=device, **kw)
        exact_o.append(exact.o)
        exact_lse.append(exact.lse)
        if case.dtype in (F16, BF16):
            base = oracle.plain_torch(q_b, k_b, v_b, **kw)
            base_o.append(base.o)
            base_lse.append(base.lse)
    baseline_o = torch.cat(base_o) if base_o else None
    baseline_lse = torch.cat(base_lse) if base_lse else None
    for name, got, want, baseline in (
        ("o", o, torch.cat(exact_o), baseline_o),
        ("lse", lse, torch.cat(exact_lse), baseline_lse),
    ):
        check = oracle.check_output(name, got, want, baseline, case.dtype)
        assert check.ok, f"{name}: {check.message} ({case})"


@st.composite
def kv_cases(draw, dtypes=(F32, F16), max_capacity: int = 96, max_head_dim: int = 64, paged=None) -> KVCase:
    """Random calls: GQA/MQA, dense or paged (pages 16..256, sizes that divide no length), lengths 0 to full,
    Nnew 0..4, Nq 1..5, masks and score modifiers each on about half the time."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    seqlen_q = draw(st.integers(1, 5))
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 64]).filter(lambda d: d <= max_head_dim))
    head_dim_v = head_dim if draw(st.booleans()) else draw(st.sampled_from([8, 16, 40]))
    is_paged = draw(st.booleans()) if paged is None else paged
    if is_paged:
        page_size = draw(st.sampled_from([16, 24, 32, 48, 64, 256]))
        pages = draw(st.integers(1, max(1, max_capacity // page_size)))
        capacity = pages * page_size
    else:
        page_size, capacity = 0, draw(st.integers(1, max_capacity))
    new_keys = draw(st.integers(0, min(4, capacity)))
    edge = st.sampled_from([0, capacity - new_keys, max(capacity - new_keys - 1, 0)])
    lengths = tuple(draw(st.one_of(edge, st.integers(0, capacity - new_keys))) for _ in range(batch))
    window = None
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(-3, capacity + 2))
        window = (draw(side), draw(side))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.5, 5.0, 30.0]))
    return KVCase(
        batch=batch, kv_heads=kv_heads, group=group, seqlen_q=seqlen_q, head_dim=head_dim, head_dim_v=head_dim_v,
        page_size=page_size, capacity=capacity, cache_seqlens=lengths, new_keys=new_keys, causal=draw(st.booleans()),
        window=window, softcap=softcap, alibi=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)), transposed=draw(st.booleans()),
    )  # fmt: skip


def run_and_judge(case: KVCase, backend, device: str = "cpu") -> None:
    """Run ``backend`` on ``case``: o/lse against the oracle, the append wrote exactly the new rows, the other
    inputs untouched."""
    x = case.make(device)
    want_k, want_v = expected_cache(x, case)
    others = {name: t.clone() for name, t in x.items() if t is not None and name not in ("k_cache", "v_cache")}
    o, lse = case.call(x, backend)
    assert torch.equal(x["k_cache"], want_k) and torch.equal(x["v_cache"], want_v), "the append wrote other rows"
    for name, before in others.items():
        assert torch.equal(x[name], before), f"{name} was modified"
    assert o.dtype == case.dtype and o.shape == (case.batch, case.heads, case.seqlen_q, case.head_dim_v)
    judge(x, case, x["k_cache"], x["v_cache"], o, lse, device="cpu")
