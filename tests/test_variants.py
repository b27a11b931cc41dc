"""``attnzoo.get(name, **options)``: a backend's variants are options of the one registry.

Without options ``get`` returns the registered instance; with options, ``type(registered)(**options)``, built once per
distinct options; an option the constructor does not take is a TypeError that names it.
"""

from __future__ import annotations

import pytest
from cases import F32, Case, run_and_check

import attnzoo
from attnzoo.backends.triton_atomic import TritonAtomic


def test_without_options_get_is_the_registered_instance():
    for name in attnzoo.names():
        assert attnzoo.get(name) is attnzoo.get(name)
        assert attnzoo.get(name).options() == {}


def test_a_variant_is_an_instance_of_the_registered_class_built_once_per_options():
    recompute = attnzoo.get("triton_atomic", delta="recompute")
    assert type(recompute) is TritonAtomic and recompute.delta == "recompute"
    assert recompute is attnzoo.get("triton_atomic", delta="recompute")
    assert recompute is not attnzoo.get("triton_atomic")
    assert attnzoo.get("triton_atomic").delta == "preprocess"  # the registered instance is untouched
    small = attnzoo.get("torch_fa2", block_m=16, block_n=32)
    assert (small.block_m, small.block_n) == (16, 32)
    assert small is attnzoo.get("torch_fa2", block_n=32, block_m=16)  # the options, not their order
    assert small is not attnzoo.get("torch_fa2", block_m=32, block_n=16)


def test_a_variant_shows_its_options():
    assert repr(attnzoo.get("triton_atomic", delta="recompute")) == "<attnzoo backend triton_atomic delta=recompute>"
    assert repr(attnzoo.get("numpy_ref", block_m=8)) == "<attnzoo backend numpy_ref block_m=8>"
    assert repr(attnzoo.get("numpy_ref")) == "<attnzoo backend numpy_ref>"


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"'torch_fa1' has no option 'blockm'.*block_m, block_n"):
        attnzoo.get("torch_fa1", blockm=16)
    with pytest.raises(TypeError, match="'block_m'"):
        attnzoo.get("triton_atomic", block_m=16)
    with pytest.raises(ValueError, match="delta"):  # a known option with a bad value: the constructor's error
        attnzoo.get("triton_atomic", delta="twice")


@pytest.mark.parametrize("name", ["numpy_ref", "torch_fa1", "torch_fa2"])
def test_reference_variants_with_small_blocks_keep_the_contract(name):
    """Blocks of 8 x 16 against 33 x 47: tails, several tiles per row, causal tiles skipped, padding."""
    backend = attnzoo.get(name, block_m=8, block_n=16)
    run_and_check(backend, Case(2, 4, 2, 33, 47, 24, True, (47, 5), F32, "bnhd", None, 7))
