"""SPEC.md, "KV cache for inference": attention_with_kvcache on dense and paged caches, the in-place append, the
split-K backend's partials and merge, and bad input; on the CPU (the Triton kernels through the interpreter)."""

from __future__ import annotations

import pytest
import torch
from cases import F32, cases
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcache_cases import F64, KVCase, kv_cases, run_and_judge

import attnzoo
from attnzoo import testing
from attnzoo.backend import interpreter_unusable_reason, triton_interpreter_active
from attnzoo.kvcache import attention_with_kvcache_op

TRITON_USABLE = triton_interpreter_active() and interpreter_unusable_reason() is None
needs_interpreter = pytest.mark.skipif(not TRITON_USABLE, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")


@settings(max_examples=30, deadline=None)
@given(case=kv_cases(dtypes=(F64, F32)), name=st.sampled_from(["numpy_ref", "torch_fa2"]))
def test_references_match_the_oracle_on_the_gathered_cache(case, name):
    run_and_judge(case, name)


@needs_interpreter
@settings(max_examples=40, deadline=None)
@given(
    case=kv_cases(dtypes=(F32,)),
    num_splits=st.sampled_from([None, 1, 2, 3, 5]),
    block_n=st.sampled_from([16, 32]),
)
def test_splitk_matches_the_oracle_on_the_gathered_cache(case, num_splits, block_n):
    """Random splits (more splits than tiles included: splits that see no key), tile widths and page sizes."""
    run_and_judge(case, attnzoo.get("triton_splitk", num_splits=num_splits, block_n=block_n))


@needs_interpreter
@settings(max_examples=25, deadline=None)
@given(data=st.data(), num_splits=st.sampled_from([None, 1, 3]))
def test_splitk_plain_forward_matches_the_oracle(data, num_splits):
    """The plain forward (SPEC.md's contract, forward only: the backward is triton_2kernel's, tested under that
    name) on the general random cases, at most 48 keys (the interpreter runs each program in Python)."""
    backend = attnzoo.get("triton_splitk", num_splits=num_splits, block_n=16)
    case = data.draw(cases(dtypes=(F32,), max_seqlen=48, max_head_dim=64), label="case")
    x = case.make("cpu")
    o, lse = backend.forward(x.q, x.k, x.v, **case.call_kwargs(x))
    judge = testing.oracle_for(x, case.causal, case.scale, window=case.window, softcap=case.softcap)
    for name, check in judge.check({"o": o, "lse": lse}).items():
        assert check.ok, f"{name}: {check.message}"


def _case(**changes) -> KVCase:
    base = dict(
        batch=3, kv_heads=2, group=2, seqlen_q=2, head_dim=16, head_dim_v=16, page_size=16, capacity=64,
        cache_seqlens=(0, 17, 60), new_keys=2, causal=True, window=None, softcap=0.0, alibi=False, dtype=F32, seed=5,
    )  # fmt: skip
    base.update(changes)
    return KVCase(**base)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_splitk_rows_with_no_key_are_zero_with_minus_inf_lse(num_splits):
    """A sequence with no key (length 0) and splits past every length: o = 0, lse = -inf, never NaN."""
    case = _case(cache_seqlens=(0, 3, 0), new_keys=0, window=(0, None))
    x = case.make()
    o, lse = case.call(x, attnzoo.get("triton_splitk", num_splits=num_splits, block_n=16))
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert not torch.isnan(o).any() and torch.isfinite(lse[1]).all()
    run_and_judge(case, attnzoo.get("triton_splitk", num_splits=num_splits, block_n=16))


@needs_interpreter
def test_splitk_merge_equals_the_single_split_result():
    """The partials merged by the Triton merge kernel equal one program over all keys (same kernel, FINAL)."""
    case = _case(capacity=96, cache_seqlens=(90, 40, 7), page_size=32)
    results = []
    for splits in (1, 6):
        x = case.make()
        results.append(case.call(x, attnzoo.get("triton_splitk", num_splits=splits, block_n=16)))
    (o1, lse1), (o6, lse6) = results
    torch.testing.assert_close(o6, o1, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse6, lse1, atol=2e-6, rtol=2e-6)


@needs_interpreter
@pytest.mark.parametrize("page_size, block_n", [(32, 16), (64, 32), (48, 16), (24, 16), (16, 32)])
def test_splitk_reads_a_page_per_tile_or_per_key(page_size, block_n):
    """A page size that is a multiple of the tile: one block-table entry per tile (the tile lies in one page); any
    other: one per key.  Both against the oracle, with splits and lengths that end inside a tile."""
    case = _case(capacity=4 * page_size, cache_seqlens=(4 * page_size - 2, page_size + 5, 0), page_size=page_size)
    run_and_judge(case, attnzoo.get("triton_splitk", num_splits=3, block_n=block_n))


def test_auto_picks_a_reference_on_the_cpu_and_appends_once():
    case = _case()
    x = case.make()
    o, lse = case.call(x, "auto")
    assert o.shape == (3, 4, 2, 16) and lse.dtype == torch.float32


def test_the_custom_op_passes_opcheck():
    case = _case(new_keys=1)
    x = case.make()
    args = (
        x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"], True,
        0.25, None, None, 0.0, None, "torch_fa2",
    )  # fmt: skip
    torch.library.opcheck(attention_with_kvcache_op, args, test_utils=("test_schema", "test_faketensor"))


# -- bad input: a clear error before anything is written --------------------------------------------------------------
def _bad(change):
    case = _case()
    x = case.make()
    x.update(change(x))
    return x


def _lengths() -> torch.Tensor:
    return torch.tensor([0, 17, 30], dtype=torch.int32)


BAD_INPUTS = [
    ("block table out of range", ValueError, "block_table entries", lambda x: {"block_table": x["block_table"] + 100}),
    ("negative block table", ValueError, "block_table entries", lambda x: {"block_table": x["block_table"] - 100}),
    ("block table int64", TypeError, "block_table must be int32", lambda x: {"block_table": x["block_table"].long()}),
    ("block table rows", ValueError, "block_table must have shape", lambda x: {"block_table": x["block_table"][:2]}),
    (
        "length beyond capacity",
        ValueError,
        "cache_seqlens \\+ Nnew",
        lambda x: {"cache_seqlens": torch.tensor([0, 17, 63], dtype=torch.int32)},
    ),
    (
        "negative length",
        ValueError,
        "cache_seqlens \\+ Nnew",
        lambda x: {"cache_seqlens": torch.tensor([0, -1, 3], dtype=torch.int32)},
    ),
    ("cache_seqlens int64", TypeError, "cache_seqlens must be int32", lambda x: {"cache_seqlens": _lengths().long()}),
    ("cache_seqlens shape", ValueError, "cache_seqlens must have shape", lambda x: {"cache_seqlens": _lengths()[:2]}),
    ("page sizes differ", ValueError, "v_cache must have", lambda x: {"v_cache": x["v_cache"][:, :, :8]}),
    ("k_new without v_new", ValueError, "k_new was given without v_new", lambda x: {"v_new": None}),
    ("v_new without k_new", ValueError, "v_new was given without k_new", lambda x: {"k_new": None}),
    ("k_new heads", ValueError, "k_new must have shape", lambda x: {"k_new": x["k_new"][:, :1]}),
    ("k_new dtype", TypeError, "k_new must have the dtype", lambda x: {"k_new": x["k_new"].double()}),
    ("cache dtype", TypeError, "same dtype", lambda x: {"k_cache": x["k_cache"].half()}),
    ("cache head dim", ValueError, "k_cache must have head dim", lambda x: {"k_cache": x["k_cache"][..., :8]}),
    ("q rank", ValueError, "q must have rank 4", lambda x: {"q": x["q"][0]}),
    ("gqa", ValueError, "multiple of the number of K/V heads", lambda x: {"q": x["q"][:, :3]}),
    ("integer q", TypeError, "q must have a floating dtype", lambda x: {"q": x["q"].int()}),
]  # fmt: skip


@pytest.mark.parametrize("what, error, words, change", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("name", ["torch_fa2", "triton_splitk"])
def test_bad_input_raises_before_anything_is_written(what, error, words, change, name):
    x = _bad(change)
    before = {key: val.clone() for key, val in x.items() if isinstance(val, torch.Tensor)}
    with pytest.raises(error, match=words):
        attnzoo.attention_with_kvcache(
            x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["k_new"], x["v_new"], x["block_table"],
            backend=name,
        )  # fmt: skip
    for key, val in before.items():
        assert torch.equal(x[key], val), f"{key} was written although the call was refused"


@pytest.mark.parametrize("name", ["torch_fa2", pytest.param("triton_splitk", marks=needs_interpreter)])
def test_block_table_entries_past_the_attended_length_may_be_minus_one(name):
    """Only the pages that hold attended keys must be valid: rows padded with -1 past them (as serving stacks pad
    their tables) give the result of the unpadded table."""
    case = _case()
    results = []
    for pad in (False, True):
        x = case.make()
        if pad:
            attended = x["cache_seqlens"] + case.new_keys
            pages_in_use = (attended + case.page_size - 1) // case.page_size
            for b, n in enumerate(pages_in_use.tolist()):
                x["block_table"][b, n:] = -1
            assert (x["block_table"] == -1).any()
        results.append(case.call(x, name))
    (o, lse), (o_padded, lse_padded) = results
    assert torch.equal(o_padded, o) and torch.equal(lse_padded, lse)


def test_dense_cache_of_the_wrong_batch_is_a_value_error():
    case = _case(page_size=0)
    x = case.make()
    with pytest.raises(ValueError, match="k_cache must have batch size 2"):
        attnzoo.attention_with_kvcache(x["q"][:2], x["k_cache"], x["v_cache"], x["cache_seqlens"][:2])


def test_a_backend_without_the_call_says_so():
    case = _case()
    x = case.make()
    with pytest.raises(NotImplementedError, match="KV-cache call"):
        attnzoo.attention_with_kvcache(
            x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], block_table=x["block_table"], backend="torch_fa1"
        )


@needs_interpreter
@settings(max_examples=10, deadline=None)
@given(case=kv_cases(dtypes=(F32,)))
def test_two_kernel_answers_the_decode_calls_it_declares(case):
    """triton_2kernel (no split, pages gathered into a dense copy) on the calls its alignment to Nk gets right; the
    others it refuses with a reason."""
    backend = attnzoo.get("triton_2kernel")
    x = case.make()
    refused = case.window not in (None, (None, None)) or case.alibi or (case.causal and case.seqlen_q > 1)
    if refused:
        with pytest.raises(NotImplementedError, match="aligned to each sequence's length"):
            case.call(x, backend)
        return
    run_and_judge(case, backend)
