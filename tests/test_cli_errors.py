"""SPEC.md, "Bad input", for the command line: a bad flag or an impossible case is one line on stderr and a non-zero
exit (argparse's 2 for usage errors), checked before any input is built or the oracle runs; never a traceback."""

from __future__ import annotations

import argparse

import pytest
import torch

from attnzoo import compare
from attnzoo.__main__ import main as cli_main
from attnzoo.bench import ab, io, plot, run

SMALL = ["--B", "1", "--H", "4", "--Hkv", "2", "--Nq", "40", "--D", "16", "--repeat", "1"]
TINY_BENCH = ["--device", "cpu", "--N", "64", "--d", "16", "--quiet", "--out", "/nonexistent/never.csv"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for a machine without CUDA")


def usage_error(argv: list[str], capsys) -> str:
    """Run ``python -m attnzoo <argv>``, expect exit 2, and return its one error line."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--H", "4", "--Hkv", "3"], "--H 4 is not a multiple of --Hkv 3"),
        (["--D", "0"], "argument --D: must be a positive integer, got 0"),
        (["--Hkv", "0"], "argument --Hkv: must be a positive integer, got 0"),
        (["--Nq", "-1"], "argument --Nq: must be an integer >= 0, got -1"),
        (["--B", "2", "--seqlens-k", "256"], "--seqlens-k needs one value per batch (B = 2), got 1"),
        (["--B", "1", "--seqlens-k", "99"], "--seqlens-k values must lie in [0, Nk] = [0, 40]"),
        (["--seqlens-k", "4,x"], "--seqlens-k must be a comma list of integers or 'random'"),
        (["--repeat", "0"], "argument --repeat: must be a positive integer, got 0"),
        (["--scale", "nan"], "argument --scale: must be finite"),
        (["--backends", "numpy_reff"], "unknown backend 'numpy_reff' (did you mean 'numpy_ref'?)"),
        (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    ],
)
def test_compare_rejects_a_bad_flag_in_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(compare.oracle, "reference", _must_not_run)
    line = usage_error(["compare", *SMALL, *flags], capsys)
    assert line.startswith("python -m attnzoo compare: error: ") and message in line


@NO_CUDA
def test_compare_without_cuda_refuses_device_cuda(capsys):
    line = usage_error(["compare", "--device", "cuda"], capsys)
    assert "--device cuda: CUDA is not available here" in line


def test_compare_fails_when_no_selected_backend_supports_the_case(capsys, monkeypatch):
    monkeypatch.setattr(compare.oracle, "reference", _must_not_run)
    # float64 is for the reference backends only; without the interpreter the Triton backends do not run on CPU.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli_main(["compare", *SMALL, "--dtype", "float64", "--backends", "triton_2kernel,triton_atomic"]) == 1
    captured = capsys.readouterr()
    assert "unsupported: dtype float64 not supported" in captured.out
    assert captured.err.strip() == "no selected backend supports this case (triton_2kernel, triton_atomic)"


def test_bare_command_prints_usage_and_exits_2(capsys):
    assert cli_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m attnzoo <command>") and err.rstrip().endswith("error: no command given")


def test_unknown_command_suggests_the_closest(capsys):
    assert cli_main(["compar"]) == 2
    assert "error: unknown command 'compar' (did you mean 'compare'?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--impl", "numpy_reff"], "unknown impl 'numpy_reff' (did you mean 'numpy_ref'?)"),
        (["--dtype", "bf61"], "unknown dtype 'bf61' (did you mean 'bf16'?)"),
        (["--mode", "fwdd"], "unknown mode 'fwdd' (did you mean 'fwd'?)"),
        (["--N", "abc"], "--N must be a comma list of positive integers, got 'abc'"),
        (["--d", "0"], "--d must be a comma list of positive integers, got '0'"),
        (["--repeat", "0"], "argument --repeat: must be a positive integer, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
        (["--H", "4", "--Hkv", "3"], "H = 4 (at D = 16) is not a multiple of --Hkv 3"),
        (["--seqlen-k-frac", "0"], "--seqlen-k-frac must lie in (0, 1], got 0"),
    ],
)
def test_bench_rejects_a_bad_flag_in_one_line(flags, message, capsys):
    line = usage_error(["bench", *TINY_BENCH, *flags], capsys)
    assert line.startswith("python -m attnzoo bench: error: ") and message in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["numpy_ref"], "give two or more impls to compare, got 1"),
        (["numpy_ref", "torch_fa3"], "unknown impl 'torch_fa3' (did you mean 'torch_fa2'?)"),
        (["numpy_ref", "torch_fa2:block_m"], "option 'block_m' is not key=value"),
        (["numpy_ref", "sdpa_math:x=1"], "options apply to attnzoo backends only"),
        (["numpy_ref", "torch_fa2:delta=recompute"], "backend 'torch_fa2' does not take these options"),
        (["numpy_ref", "torch_fa2", "--N", "0"], "--N must be a comma list of positive lengths"),
    ],
)
def test_bench_ab_rejects_bad_impls_in_one_line(argv, message, capsys):
    line = usage_error(["bench", "ab", "--device", "cpu", *argv], capsys)
    assert line.startswith("python -m attnzoo bench ab: error: ") and message in line


def test_plot_refuses_what_is_not_a_bench_csv(tmp_path, capsys):
    assert "no such file" in usage_error(["plot", str(tmp_path / "missing.csv")], capsys)
    other = tmp_path / "io.csv"
    other.write_text("impl,pass,N\ntriton_2kernel,fwd,1024\n")
    assert "is not a CSV of python -m attnzoo bench (no column mode, D, status)" in usage_error(
        ["plot", str(other)], capsys
    )


def test_io_plot_refuses_a_bench_csv(tmp_path, capsys):
    bench_csv = tmp_path / "bench.csv"
    bench_csv.write_text("dtype,mode,impl,N,D,status\nfp32,fwd,numpy_ref,64,16,ok\n")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["io", "plot", str(bench_csv)])
    assert "is not a CSV of python -m attnzoo io measure (no column pass, dram_read_bytes" in str(exit_info.value)


def test_bench_ab_times_every_impl_on_the_same_inputs_in_alternating_rounds(tmp_path, capsys):
    out = tmp_path / "ab.csv"
    argv = ["--device", "cpu", "--d", "16", "--N", "64", "--rounds", "2", "--repeat", "1", "--warmup", "0"]
    assert ab.main(["numpy_ref", "torch_fa2", *argv, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "fp32 D=16 N=64 full" in table and "numpy_ref" in table and "torch_fa2" in table
    rows = out.read_text().splitlines()[1:]
    assert [row.split(",")[1:3] for row in rows] == [
        ["0", "numpy_ref"],
        ["0", "torch_fa2"],
        ["1", "torch_fa2"],
        ["1", "numpy_ref"],
    ]


def test_bench_ab_times_a_backend_against_itself_with_a_pinned_config(tmp_path, capsys):
    """``name:configs.<kernel>=<config>`` builds the backend with that config pinned, labelled as given."""
    out = tmp_path / "ab.csv"
    pinned = "triton_2kernel:configs.forward=64x64 w4 s3"
    argv = ["--device", "cpu", "--mode", "fwd", "--d", "16", "--N", "64", "--rounds", "1", "--repeat", "1"]
    assert ab.main(["triton_2kernel", pinned, *argv, "--warmup", "0", "--out", str(out)]) == 0
    assert pinned in capsys.readouterr().out
    assert [row.split(",")[2] for row in out.read_text().splitlines()[1:]] == ["triton_2kernel", pinned]


def test_bench_ab_replot_summarises_its_csv_and_draws_the_ratios(tmp_path, capsys):
    """``--replot``: per shape, each impl's median forward and backward over the rounds and the first impl's backward
    over its own; ``--plot`` draws them.  Timing flags are not needed, impls are refused."""
    out, png = tmp_path / "ab.csv", tmp_path / "ab.png"
    out.write_text(
        "shape,round,impl,fwd_ms,bwd_ms\n"
        "fp16 D=64 N=1024 full B=1 H=2,0,a,1.0,4.0\nfp16 D=64 N=1024 full B=1 H=2,0,b,1.0,2.0\n"
        "fp16 D=64 N=1024 full B=1 H=2,1,b,1.0,3.0\nfp16 D=64 N=1024 full B=1 H=2,1,a,1.0,4.0\n"
    )
    assert ab.main(["--replot", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "fp16 D=64 N=1024 full B=1 H=2:" in table
    assert [line.split()[-1] for line in table.splitlines()[1:]] == ["x1.000", "x1.600"]  # 4.0 / median(2, 3)
    assert png.stat().st_size > 0
    assert "give no impls" in usage_error(["bench", "ab", "numpy_ref", "--replot", str(out)], capsys)
    assert "--plot draws a --replot summary" in usage_error(
        ["bench", "ab", "--device", "cpu", "numpy_ref", "torch_fa2", "--plot", str(png)], capsys
    )


def _parsers() -> list[argparse.ArgumentParser]:
    io_parser = io.build_parser()
    subparsers = [
        parser
        for action in io_parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for parser in action.choices.values()
    ]
    return [compare._parser(), run.build_parser(cuda=False), ab.build_parser(), plot.build_parser(), *subparsers]


def test_every_flag_of_every_command_has_help():
    for parser in _parsers():
        undocumented = [a.dest for a in parser._actions if not a.help and not isinstance(a, argparse._HelpAction)]
        assert not undocumented, f"{parser.prog}: {undocumented}"


def _must_not_run(*args, **kwargs):
    raise AssertionError("the oracle ran before the flags were checked")


def test_plot_draws_a_cpu_csv_without_sdpa_rows_and_says_why_there_is_no_summary(tmp_path, capsys):
    csv_path = tmp_path / "cpu_bench.csv"
    argv = ["--device", "cpu", "--dtype", "fp32", "--d", "16", "--N", "64", "--causal", "no", "--B", "1", "--H", "1"]
    assert (
        run.main([*argv, "--impl", "numpy_ref", "--warmup", "0", "--repeat", "1", "--quiet", "--out", str(csv_path)])
        == 0
    )
    assert plot.main([str(csv_path), "--out-dir", str(tmp_path), "--prefix", "cpu", "--dpi", "20"]) == 0
    assert len(list(tmp_path.glob("cpu_*_fp32_d16_full.png"))) == len(plot.FIGURE_KINDS)
    assert not (tmp_path / "cpu_speedup_summary.png").exists()
    assert "no speedup summary: no train row has a speedup over sdpa_flash" in capsys.readouterr().err
