"""``python -m attnzoo tune``: bad flags are one-line usage errors; without a GPU it says so and exits non-zero."""

from __future__ import annotations

import pytest
import torch

from attnzoo import tune


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp8"], "--dtype: unknown 'fp8'"),
        (["--d", "0"], "head dims must lie in 1..256"),
        (["--N", "0"], "sequence lengths must be positive"),
        (["--N", "x"], "--d/--N"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--layout", "padded"], "argument --layout: invalid choice"),
        (["--kernels", "dq,backward"], "--kernels: comma list of forward, dq, dkdv, atomic"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_layout_picks_dense_packed_or_both():
    assert tune.parse_args([]).packed_layouts == (False,)
    assert tune.parse_args(["--layout", "packed"]).packed_layouts == (True,)
    assert tune.parse_args(["--layout", "both"]).packed_layouts == (False, True)


def test_kernels_restricts_the_timing():
    assert tune.parse_args([]).kernel_names is None
    assert tune.parse_args(["--kernels", "dq,dkdv"]).kernel_names == ("dq", "dkdv")


def test_lengths_read_k_suffixes():
    assert tune._lengths("1k, 4096,16K") == [1024, 4096, 16384]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_why(capsys):
    assert tune.main(["--d", "64"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
