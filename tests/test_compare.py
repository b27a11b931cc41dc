"""``python -m attnzoo compare``: one table of every backend vs the oracle; non-zero exit when one is off."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo import compare, testing
from attnzoo.__main__ import main as cli_main

SMALL = ["--B", "1", "--H", "4", "--Hkv", "2", "--Nq", "40", "--Nk", "56", "--D", "16", "--repeat", "1"]


def test_compare_prints_every_backend_and_passes(capsys):
    assert cli_main(["compare", *SMALL, "--causal", "--seqlens-k", "30"]) == 0
    out = capsys.readouterr().out
    for name in attnzoo.names():
        assert name in out
    assert "OUT OF TOLERANCE" not in out and "causal=True" in out


def test_compare_fails_on_a_wrong_backend(capsys, monkeypatch):
    backend = attnzoo.get("torch_fa2")
    real = backend._forward

    def off_by_a_bit(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o * 1.01, lse

    monkeypatch.setattr(backend, "_forward", off_by_a_bit)
    assert compare.main([*SMALL, "--backends", "torch_fa2,numpy_ref"]) == 1
    out = capsys.readouterr().out
    assert "outside tolerance: torch_fa2" in out


def test_compare_reports_why_a_backend_cannot_run(capsys):
    assert compare.main([*SMALL, "--dtype", "float64", "--backends", "numpy_ref"]) == 0
    meta = [torch.zeros(1, 1, 2, 4, device="meta") for _ in range(3)]
    inputs = testing.AttentionInputs(*meta, do=None, seqlens_k=None)
    rows = compare.run_backend(attnzoo.get("numpy_ref"), inputs, False, None, "cpu", 1, None)
    assert rows.reasons and "device meta" in rows.reasons[0]
    assert "unsupported: device meta" in compare.format_table([rows])


def test_cli_usage(capsys):
    assert cli_main(["--help"]) == 0
    assert "compare" in capsys.readouterr().out
    assert cli_main(["nonsense"]) == 2


def test_compare_takes_the_score_modifiers_and_dv(capsys):
    args = ["--window", "none,3", "--softcap", "5", "--alibi", "--Dv", "24", "--causal"]
    assert compare.main([*SMALL, *args, "--backends", "numpy_ref,torch_fa2"]) == 0
    out = capsys.readouterr().out
    assert "Dv=24" in out and "window=(None, 3)" in out and "softcap=5.0" in out and "alibi" in out
    assert out.count(" ok") == 2


def test_compare_rejects_bad_modifier_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:  # argparse: a usage line and the error
        compare.main([*SMALL, "--window", "3"])
    assert info.value.code == 2 and "--window" in capsys.readouterr().err
    assert compare.main([*SMALL, "--softcap", "-1"]) == 2
    err = capsys.readouterr().err
    assert "softcap" in err and len(err.strip().splitlines()) == 1


def test_alibi_slopes_are_bloom_s():
    assert compare.alibi_slopes(4) == [2**-2, 2**-4, 2**-6, 2**-8]
    assert compare.alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
