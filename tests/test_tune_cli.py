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
        (["--window", "4096"], "--window: expected LEFT,RIGHT"),
        (["--window", "a,0"], "--window: expected LEFT,RIGHT"),
        (["--window", "none,none"], "--window: none,none is no window"),
        (["--softcap", "-1"], "--softcap: softcap must be 0 (off) or positive"),
        (["--softcap", "inf"], "--softcap: softcap must be 0 (off) or positive"),
        (["--softcap", "1e-40"], "within float32's normal range"),
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


def test_window_and_softcap_reach_every_tuned_call():
    """``--window``/``--softcap`` become the keyword arguments of the compile jobs' and the timed calls' forward and
    backward (their tuning keys are their own)."""
    args = tune.parse_args(["--window", "4095,0", "--softcap", "30"])
    assert args.modifiers == (("window", (4095, 0)), ("softcap", 30.0))
    assert tune.parse_args(["--window", "none,64"]).modifiers == (("window", (None, 64)),)
    assert tune.parse_args([]).modifiers == ()

    calls = []

    class Recorder:
        def forward(self, q, k, v, **kwargs):
            calls.append(("forward", kwargs))
            return q, None

        def backward(self, do, q, k, v, o, lse, **kwargs):
            calls.append(("backward", kwargs))

    x = torch.randn(1, 1, 4, 8)
    tune._run_both_ways(Recorder(), x, x, x, x, True, None, modifiers=args.modifiers)
    expected = dict(causal=True, window=(4095, 0), softcap=30.0)
    assert calls == [("forward", expected), ("backward", expected)]


def test_lengths_read_k_suffixes():
    assert tune._lengths("1k, 4096,16K") == [1024, 4096, 16384]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_why(capsys):
    assert tune.main(["--d", "64"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
