"""The KV-cache call on the GPU: triton_splitk (and triton_2kernel where it answers) against the float64 oracle in
every dtype at decoding sizes, paged and dense; CUDA-graph capture of a decode step; torch.compile."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcache_cases import BF16, F16, F32, KVCase, kv_cases, run_and_judge

import attnzoo

pytestmark = pytest.mark.gpu


@settings(max_examples=60, deadline=None)
@given(case=kv_cases(dtypes=(F32, F16, BF16), max_capacity=1500, max_head_dim=64), splits=st.sampled_from([None, 1, 7]))
def test_splitk_matches_the_oracle(case, splits):
    run_and_judge(case, attnzoo.get("triton_splitk", num_splits=splits), device="cuda")


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("page_size", [0, 64, 48])
@pytest.mark.parametrize("seqlen_q, causal", [(1, True), (4, True), (4, False)])
def test_decode_shapes_h32_hkv8_d128(dtype, page_size, seqlen_q, causal):
    """The benchmark's shape family (H = 32, Hkv = 8, D = 128) at a length that needs many splits."""
    case = KVCase(
        batch=3, kv_heads=8, group=4, seqlen_q=seqlen_q, head_dim=128, head_dim_v=128, page_size=page_size,
        capacity=4800 if page_size != 64 else 4864, cache_seqlens=(4000, 17, 0), new_keys=seqlen_q, causal=causal,
        window=None, softcap=0.0, alibi=False, dtype=dtype, seed=3,
    )  # fmt: skip
    run_and_judge(case, attnzoo.get("triton_splitk"), device="cuda")
    if not causal or seqlen_q == 1:
        run_and_judge(case, attnzoo.get("triton_2kernel"), device="cuda")


def _decode_case() -> KVCase:
    return KVCase(
        batch=2, kv_heads=2, group=4, seqlen_q=1, head_dim=64, head_dim_v=64, page_size=16, capacity=256,
        cache_seqlens=(100, 37), new_keys=1, causal=True, window=None, softcap=0.0, alibi=False, dtype=F16, seed=9,
    )  # fmt: skip


def test_a_decode_step_replays_as_a_cuda_graph():
    case = _decode_case()
    x = case.make("cuda")
    eager_k, eager_v = x["k_cache"].clone(), x["v_cache"].clone()
    o_eager = attnzoo.attention_with_kvcache(
        x["q"], eager_k, eager_v, x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"]
    )
    k, v = x["k_cache"].clone(), x["v_cache"].clone()

    def step():
        return attnzoo.attention_with_kvcache(
            x["q"], k, v, x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"]
        )

    step()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = step()
    k.copy_(x["k_cache"])
    v.copy_(x["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(k, eager_k) and torch.equal(v, eager_v)


def test_torch_compile_fullgraph():
    case = _decode_case()
    x = case.make("cuda")
    k, v = x["k_cache"].clone(), x["v_cache"].clone()

    @torch.compile(fullgraph=True)
    def step(q, k_cache, v_cache, lengths, k_new, v_new, table):
        return attnzoo.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, table) * 2

    got = step(x["q"], k, v, x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"])
    want_k, want_v = x["k_cache"].clone(), x["v_cache"].clone()
    want = attnzoo.attention_with_kvcache(
        x["q"], want_k, want_v, x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"]
    )
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.testing.assert_close(got, want * 2)
