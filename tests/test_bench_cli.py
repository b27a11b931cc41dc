"""``python -m attnzoo bench``, ``plot`` and ``io theory`` on the CPU path, with a tiny grid (issue 5).

The timing numbers of a CPU run mean little; these tests check the contract of the tools: one CSV row per case
with the issue's columns, skipped and out-of-memory cases recorded rather than dropped or fatal, FLOP and
speedup arithmetic, the figures and README table drawn from the CSV, and the IO-complexity formulas.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.bench import impls, io_theory, ncu, plot, run, timing
from attnzoo.bench import io as io_cli
from attnzoo.bench.schema import COLUMNS, backward_flops, forward_flops, read_csv

# The CSV schema, in the order issue 5 lists it.
ISSUE_COLUMNS = [
    "gpu_name",
    "gpu_sm",
    "driver",
    "torch_version",
    "triton_version",
    "dtype",
    "mode",
    "impl",
    "B",
    "H",
    "Hkv",
    "N",
    "D",
    "causal",
    "seqlen_k",
    "fwd_ms",
    "bwd_ms",
    "total_ms",
    "tflops_fwd",
    "tflops_bwd",
    "tokens_per_s",
    "peak_mem_mb",
    "speedup_vs_sdpa_flash",
    "speedup_vs_sdpa_cudnn",
    "skip_ratio",
    "status",
]

TINY = ["--device", "cpu", "--dtype", "fp32", "--d", "16", "--warmup", "0", "--repeat", "1", "--quiet"]


@pytest.fixture(scope="module")
def tiny_csv(tmp_path_factory):
    """One small CPU grid shared by the tests below: 3 impls x 2 modes x 2 causal x 1 N = 12 cases."""
    out = tmp_path_factory.mktemp("bench") / "cpu_bench.csv"
    argv = [*TINY, "--N", "128", "--B", "1", "--H", "2", "--impl", "numpy_ref,sdpa_flash,sdpa_cudnn"]
    assert run.main([*argv, "--out", str(out)]) == 0
    return out


def test_warm_up_runs_at_least_its_calls_and_its_time_before_timing():
    """``--warmup-ms``: untimed calls go on until they have run that long, then exactly ``repeat`` are timed."""
    calls = []

    def step():
        calls.append(time.perf_counter())
        time.sleep(0.002)

    timing.median_ms(step, torch.device("cpu"), warmup=2, repeat=3, warmup_ms=30.0)
    untimed = calls[:-3]
    assert len(untimed) >= 2 and calls[-3] - untimed[0] >= 0.030
    calls.clear()
    timing.median_ms(step, torch.device("cpu"), warmup=2, repeat=3)
    assert len(calls) == 5


def test_host_time_is_the_median_of_single_calls():
    """``timing.host_us``: each of ``calls`` calls timed alone, their median in microseconds."""
    durations = iter([0.001, 0.003, 0.002])
    assert 1500 < timing.host_us(lambda: time.sleep(next(durations)), torch.device("cpu"), calls=3) < 5000


def test_csv_has_the_issue_columns_and_one_row_per_case(tiny_csv):
    with open(tiny_csv) as f:
        assert f.readline().strip().split(",") == ISSUE_COLUMNS == COLUMNS
    rows = read_csv(tiny_csv)
    cases = {(r["impl"], r["mode"], r["causal"], r["N"]) for r in rows}
    assert len(rows) == len(cases) == 3 * 2 * 2


def test_cpu_rows_are_timed_and_counted_as_spec_says(tiny_csv):
    for row in read_csv(tiny_csv):
        if row["impl"] == "sdpa_cudnn":
            continue
        assert row["status"] == "ok", row
        assert row["fwd_ms"] > 0 and row["total_ms"] > 0
        flops = forward_flops(row["B"], row["H"], row["N"], row["D"], row["causal"], row["seqlen_k"])
        assert row["tflops_fwd"] == pytest.approx(flops / (row["fwd_ms"] * 1e-3) / 1e12, rel=1e-4)
        assert row["tokens_per_s"] == pytest.approx(row["B"] * row["N"] / (row["total_ms"] * 1e-3), rel=1e-4)
        assert row["peak_mem_mb"] is None  # no allocator peak counter on the CPU
        if row["mode"] == "train":
            assert row["total_ms"] == pytest.approx(row["fwd_ms"] + row["bwd_ms"], rel=1e-4)
            bwd = backward_flops(row["B"], row["H"], row["N"], row["D"], row["causal"], row["seqlen_k"])
            assert row["tflops_bwd"] == pytest.approx(bwd / (row["bwd_ms"] * 1e-3) / 1e12, rel=1e-4)
        else:
            assert row["bwd_ms"] is None and row["total_ms"] == pytest.approx(row["fwd_ms"], rel=1e-4)


def test_gpu_only_impls_are_written_as_skipped_with_the_reason(tiny_csv):
    cudnn = [r for r in read_csv(tiny_csv) if r["impl"] == "sdpa_cudnn"]
    assert len(cudnn) == 4
    assert all(r["status"] == "skipped: needs CUDA" and r["fwd_ms"] is None for r in cudnn)


def test_speedup_is_the_time_ratio_to_sdpa_flash_in_the_same_run(tiny_csv):
    rows = read_csv(tiny_csv)
    flash = {(r["mode"], r["causal"], r["N"]): r["total_ms"] for r in rows if r["impl"] == "sdpa_flash"}
    for row in rows:
        if row["impl"] == "numpy_ref":
            ref = flash[(row["mode"], row["causal"], row["N"])]
            assert row["speedup_vs_sdpa_flash"] == pytest.approx(ref / row["total_ms"], rel=1e-3)
        assert row["speedup_vs_sdpa_cudnn"] is None  # no cuDNN row ran


def test_skip_ratio_is_the_fraction_of_fully_masked_tiles(tiny_csv):
    # numpy_ref uses 64 x 64 tiles: at N=128 causal, 1 of the 2 x 2 tiles lies above the diagonal.
    rows = {(r["impl"], r["mode"], r["causal"], r["N"]): r for r in read_csv(tiny_csv)}
    assert rows[("numpy_ref", "fwd", True, 128)]["skip_ratio"] == 0.25
    assert rows[("numpy_ref", "fwd", False, 128)]["skip_ratio"] == 0.0
    assert impls.geometric_skip_ratio(256, 256, 64, 64, causal=True, seqlens_k=None) == 6 / 16
    # key lengths: keys from 64 on are masked, so half the tile columns are empty
    assert impls.geometric_skip_ratio(128, 128, 64, 64, causal=False, seqlens_k=[64]) == 0.5


def test_out_of_memory_is_recorded_and_the_grid_goes_on(tmp_path, monkeypatch):
    def out_of_memory(self, inputs, train):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(impls.SdpaImpl, "prepare", out_of_memory)
    out = tmp_path / "oom.csv"
    argv = [*TINY, "--N", "32", "--B", "1", "--H", "1", "--causal", "no", "--mode", "fwd"]
    assert run.main([*argv, "--impl", "sdpa_math,numpy_ref", "--out", str(out)]) == 0
    status = {r["impl"]: r["status"] for r in read_csv(out)}
    assert status == {"sdpa_math": "oom", "numpy_ref": "ok"}


def test_a_failing_impl_is_an_error_row_not_a_crash(tmp_path, monkeypatch):
    def broken(self, inputs, train):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(impls.SdpaImpl, "prepare", broken)
    out = tmp_path / "err.csv"
    argv = [*TINY, "--N", "32", "--B", "1", "--H", "1", "--causal", "no", "--mode", "fwd", "--impl", "sdpa_math"]
    assert run.main([*argv, "--out", str(out)]) == 0
    assert read_csv(out)[0]["status"] == "error: RuntimeError: illegal memory access"


def test_too_slow_skips_that_impl_at_larger_N(tmp_path):
    out = tmp_path / "slow.csv"
    argv = [*TINY, "--N", "32,64", "--B", "1", "--H", "1", "--causal", "no", "--mode", "fwd", "--impl", "numpy_ref"]
    assert run.main([*argv, "--max-call-s", "0", "--out", str(out)]) == 0
    small, large = read_csv(out)
    assert small["status"].startswith("skipped: too slow (one step took")
    assert large["status"] == "skipped: too slow at N=32 (--max-call-s)"


def _row(mode, impl, fwd_ms, N=64):
    shape = dict(dtype="fp16", B=1, H=2, Hkv=2, N=N, D=64, causal=False, seqlen_k=N)
    return {**shape, "mode": mode, "impl": impl, "fwd_ms": fwd_ms, "status": "ok"}


def test_recheck_flags_forward_times_that_cannot_differ():
    """Same call in two modes, or two impls with one forward kernel: more than the factor apart -> re-measure."""
    code = {"triton_2kernel": "fa2 forward", "triton_atomic": "fa2 forward", "sdpa_flash": None}
    rows = [
        # N=64: consistent (10% apart at most)
        _row("fwd", "sdpa_flash", 1.0), _row("train", "sdpa_flash", 1.1),
        _row("fwd", "triton_2kernel", 0.5), _row("fwd", "triton_atomic", 0.52),
        # N=128: sdpa_flash's forward 2x slower in fwd mode than in train mode
        _row("fwd", "sdpa_flash", 2.0, 128), _row("train", "sdpa_flash", 1.0, 128),
        # N=256: two impls running the same forward kernel, 1.5x apart in train mode
        _row("train", "triton_2kernel", 1.5, 256), _row("train", "triton_atomic", 1.0, 256),
        # N=512: different forward code may differ freely
        _row("fwd", "sdpa_flash", 3.0, 512), _row("fwd", "triton_2kernel", 1.0, 512),
    ]  # fmt: skip
    flagged = run.inconsistent_shapes(rows, 1.15, code)
    assert sorted(shape[4] for shape in flagged) == [128, 256]


def test_a_slow_stretch_is_measured_again(tmp_path, monkeypatch, capsys):
    """numpy_ref's fwd-mode forward comes out 50x slow once: its shape is re-run and the CSV keeps the new rows.

    (The factors are far above ``--recheck 3`` because the real timings of a tiny CPU problem vary too.)"""
    measure, calls, slow = run.measure, [], []

    def first_fwd_slow(case, impl, inputs, args, baseline):
        result = measure(case, impl, inputs, args, baseline)
        calls.append(case.mode)
        if case.mode == "fwd" and calls.count("fwd") == 1:
            result = {**result, "fwd_ms": 50 * result["fwd_ms"], "total_ms": 50 * result["total_ms"]}
            slow.append(result["fwd_ms"])
        return result

    monkeypatch.setattr(run, "measure", first_fwd_slow)
    out = tmp_path / "recheck.csv"
    argv = [*TINY, "--N", "64", "--B", "1", "--H", "1", "--causal", "no", "--impl", "numpy_ref", "--repeat", "5"]
    assert run.main([*argv, "--recheck", "3", "--out", str(out)]) == 0
    assert calls == ["fwd", "train", "fwd", "train"]
    assert "re-measured" in capsys.readouterr().err
    fwd, _train = read_csv(out)
    assert fwd["mode"] == "fwd" and fwd["fwd_ms"] != pytest.approx(slow[0])


def test_a_slow_re_measurement_does_not_replace_a_good_first_one(tmp_path, monkeypatch):
    """The slow stretch falls on the re-measurement (the third call): each row keeps its faster measurement."""
    measure, calls = run.measure, []

    def slow_after_the_first_two(case, impl, inputs, args, baseline):
        result = measure(case, impl, inputs, args, baseline)
        calls.append(case.mode)
        if len(calls) == 1:  # inconsistent on purpose, so that the shape is re-measured: fwd mode 50x slow ...
            result = {**result, "fwd_ms": 50 * result["fwd_ms"], "total_ms": 50 * result["total_ms"]}
        if len(calls) >= 3:  # ... and then both re-measurements 500x slow
            result = {**result, "fwd_ms": 500 * result["fwd_ms"], "total_ms": 500 * result["total_ms"]}
        result["call"] = len(calls)
        return result

    monkeypatch.setattr(run, "measure", slow_after_the_first_two)
    monkeypatch.setattr(run, "write_csv", lambda *a, **k: None)
    argv = [*TINY, "--N", "64", "--B", "1", "--H", "1", "--causal", "no", "--impl", "numpy_ref", "--repeat", "5"]
    args = run.parse_args([*argv, "--recheck", "3"])
    rows = run.run_grid(run.build_grid(args), args, torch.device("cpu"))
    assert calls == ["fwd", "train", "fwd", "train"]
    # fwd mode: first run 50x slow, re-run 500x slow -> the first; train mode: first run normal -> the first.
    assert [row["call"] for row in rows] == [1, 2]


def test_token_budget_sets_B_and_H():
    args = run.parse_args(["--device", "cpu", "--N", "1024,4k", "--d", "64", "--tokens", "16384", "--width", "2048"])
    cases = run.build_grid(args)
    shapes = {(c.N, c.B, c.H) for c in cases}
    assert shapes == {(1024, 16, 32), (4096, 4, 32)}


def test_inputs_are_fresh_random_never_zeros():
    args = run.parse_args([*TINY, "--N", "64", "--B", "1", "--H", "1", "--impl", "numpy_ref", "--causal", "no"])
    fwd, train = run.build_grid(args)
    a, b = run.make_inputs(train, torch.device("cpu"), 0), run.make_inputs(fwd, torch.device("cpu"), 0)
    for t in (a.q, a.k, a.v, a.do):
        assert t.count_nonzero() == t.numel() and 0.5 < t.std() < 2
    assert not torch.equal(a.q, b.q)  # each case draws its own inputs
    assert b.do is None  # no gradient input in forward mode


def test_unknown_impl_fails_before_running(capsys):
    with pytest.raises(SystemExit):
        run.main([*TINY, "--impl", "flash3", "--out", "/nonexistent/x.csv"])
    assert "unknown impl 'flash3'" in capsys.readouterr().err


def test_plot_draws_the_six_kinds_per_group_and_the_readme_table(tiny_csv, tmp_path):
    # one (dtype, D, causal) group keeps the test fast
    rows = [r for r in read_csv(tiny_csv) if not r["causal"]]
    small = tmp_path / "one_group.csv"
    from attnzoo.bench.schema import write_csv

    write_csv(small, rows)
    assert plot.main([str(small), "--out-dir", str(tmp_path), "--prefix", "cpu", "--dpi", "30"]) == 0
    for kind in plot.FIGURE_KINDS:
        png = tmp_path / f"cpu_{kind}_fp32_d16_full.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", kind
    assert (tmp_path / "cpu_speedup_summary.png").exists()
    text = plot.readme_section(rows, [128], "cpu", "one_group.csv")
    assert "| fp32, 16, no | 128 |" in text
    assert "sdpa_flash fwd/bwd" in text and "skipped" in text  # cuDNN's cells say why they are empty


def test_readme_block_is_regenerated_between_its_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# Benchmarks\n\nintro\n")
    plot.write_generated_block(path, "table v1")
    path.write_text(path.read_text() + "\nhand-written closing note\n")
    plot.write_generated_block(path, "table v2")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("hand-written closing note\n")
    assert "table v2" in text and "table v1" not in text


# -- io: theory ------------------------------------------------------------------------------------------------------
def test_standard_attention_moves_theta_N2_plus_Nd():
    N, d = 4096, 64
    assert io_theory.standard_forward_elements(N, d) == 4 * N * N + 4 * N * d
    assert io_theory.standard_backward_elements(N, d) == 7 * N * N + 8 * N * d
    row = io_theory.theory_row("fwd", N, d, B=2, H=3, elem_bytes=2)
    assert row.standard_bytes == (4 * N * N + 4 * N * d) * 6 * 2
    assert row.standard_fp32_bytes == 2 * row.standard_bytes


def test_flash_attention_moves_theta_N2_d2_over_M():
    d, M = 64, 4 * 64 * 256  # column blocks of Bc = M / 4d = 256 keys
    for N in (16384, 32768):
        exact = io_theory.flash1_forward_elements(N, d, M)
        assert exact == pytest.approx(12 * N * N * d * d / M, rel=0.05)  # Theorem 2's leading term
    # halving the SRAM roughly doubles the traffic; the minimum is read-once-write-once
    big, small = (io_theory.flash1_forward_elements(16384, d, m) for m in (M, M / 2))
    assert small / big == pytest.approx(2, rel=0.05)
    assert io_theory.flash1_forward_elements(1024, d, 1e9) == pytest.approx(
        io_theory.minimum_forward_elements(1024, d) + 2 * 1024 * d + 4 * 1024, rel=1e-9
    )  # everything fits: one column block; above the minimum, O, l, m are initialised in HBM and read back once


def test_flash2_rereads_kv_once_per_row_block():
    N, d = 8192, 128
    assert io_theory.flash2_forward_elements(N, d, 128) - io_theory.flash2_forward_elements(N, d, 256) == (
        2 * N * d * (N // 128 - N // 256)
    )


def test_io_theory_cli_writes_a_csv_over_N(tmp_path, capsys):
    out = tmp_path / "theory.csv"
    assert io_cli.main(["theory", "--N", "512,1k,2k", "--D", "64", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].split(",") == io_theory.THEORY_COLUMNS
    assert len(lines) == 1 + 2 * 3  # fwd and bwd for each N
    fwd = [dict(zip(lines[0].split(","), line.split(","), strict=True)) for line in lines[1:4]]
    ratios = [float(r["standard_over_flash1"]) for r in fwd]
    assert ratios == sorted(ratios)  # the advantage grows with N towards M / (3 d^2)
    assert ratios[-1] < io_theory.H100_SRAM_BYTES / 2 / (3 * 64 * 64)
    assert io_cli.main(["--N", "1024", "--D", "64"]) == 0  # theory is the default subcommand, to stdout
    assert capsys.readouterr().out.startswith("pass,N,D,")


NCU_DETAILS = """==PROF== Connected to process 600 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","600","python3.12","127.0.0.1","fwd_kernel","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4,227,072"
"0","600","python3.12","127.0.0.1","fwd_kernel","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","6.5"
"0","600","python3.12","127.0.0.1","fwd_kernel","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","36,928"
"1","600","python3.12","127.0.0.1","copy","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000"
"1","600","python3.12","127.0.0.1","copy","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","2,000"
"1","600","python3.12","127.0.0.1","copy","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1.5"
==PROF== Disconnected from process 600
"""  # noqa: E501


def test_ncu_csv_is_summed_over_the_kernels_of_one_call():
    kernels = ncu.parse_ncu_csv(NCU_DETAILS)
    assert [k.kernel for k in kernels] == ["fwd_kernel", "copy"]
    total = ncu.summed(kernels)
    assert total["kernels"] == 2
    assert total["dram_read_bytes"] == 4_227_072 + 1_000
    assert total["dram_write_bytes"] == 6_500 + 2_000
    assert math.isclose(total["gpu_seconds"], 36_928e-9 + 1.5e-6)
    assert total["kernel_ms"] == "fwd_kernel=0.03693;copy=0.0015"


def test_kernel_names_lose_template_arguments_and_parameters():
    assert ncu._short_name("void flash::flash_bwd_kernel<Traits<128, 64>, true>(Params)") == "flash::flash_bwd_kernel"
    assert ncu._short_name("dkdv_kernel") == "dkdv_kernel"


def test_ncu_command_profiles_only_the_bracketed_call_with_unlocked_clocks():
    cmd = ncu.ncu_command("/tmp/log.csv", ["python", "-m", "attnzoo", "io", "target"])
    joined = " ".join(cmd)
    assert "--profile-from-start off" in joined and "--clock-control none" in joined
    assert "--metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum" in joined
    assert cmd[-5:] == ["python", "-m", "attnzoo", "io", "target"]


def test_flops_count_only_the_visible_pairs():
    """SPEC.md's counts (4·B·H·N²·D, half causal) with every key valid; padded keys are work not done."""
    assert forward_flops(2, 3, 8, 16, False) == 4 * 2 * 3 * 8 * 8 * 16
    assert forward_flops(2, 3, 8, 16, True) == 4 * 2 * 3 * 8 * 8 * 16 / 2
    assert forward_flops(1, 1, 8, 16, False, seqlen_k=2) == 4 * 8 * 2 * 16
    assert forward_flops(1, 1, 8, 16, True, seqlen_k=2) == 4 * (2 * 2 / 2 + 6 * 2) * 16
    assert backward_flops(1, 1, 8, 16, True, seqlen_k=2) == 2.5 * forward_flops(1, 1, 8, 16, True, seqlen_k=2)


def test_an_impl_spec_names_a_backend_variant_by_its_get_options():
    assert impls.parse_impl_spec("triton_atomic") == ("triton_atomic", {})
    assert impls.parse_impl_spec("torch_fa2:block_m=16,block_n=32") == ("torch_fa2", {"block_m": 16, "block_n": 32})
    assert impls.parse_impl_spec("triton_2kernel:configs.forward=128x64 w8 s3") == (
        "triton_2kernel",
        {"configs": {"forward": "128x64 w8 s3"}},
    )
    with pytest.raises(ValueError, match="not key=value"):
        impls.parse_impl_spec("torch_fa2:block_m")
    impl = impls.get_impl("torch_fa2:block_m=16,block_n=32")
    assert impl.backend is attnzoo.get("torch_fa2", block_m=16, block_n=32)
    assert impl.name == "torch_fa2:block_m=16,block_n=32"
    with pytest.raises(TypeError, match="no option 'blockm'"):
        impls.get_impl("torch_fa2:blockm=16")
    with pytest.raises(ValueError, match="takes no options"):
        impls.get_impl("sdpa_math:block_m=16")


def test_impl_lists_keep_the_options_of_each_spec_together():
    text = "numpy_ref,torch_fa2:block_m=16,block_n=32,sdpa_math,triton_atomic:delta=recompute"
    assert impls.split_impl_list(text) == [
        "numpy_ref",
        "torch_fa2:block_m=16,block_n=32",
        "sdpa_math",
        "triton_atomic:delta=recompute",
    ]


def test_the_recompute_variant_keeps_the_label_of_the_committed_grids():
    """bench/results' H100 CSVs call triton_atomic:delta=recompute triton_atomic_recompute; the plots and the README
    table count it among our impls."""
    assert impls.impl_label("triton_atomic:delta=recompute") == "triton_atomic_recompute"
    assert impls.impl_label("numpy_ref:block_m=16") == "numpy_ref:block_m=16"
    rows = read_csv(Path(__file__).resolve().parent.parent / "bench/results/h100_bench_fp16.csv")
    assert "triton_atomic_recompute" in {r["impl"] for r in rows}
    header = plot.readme_table(rows, [16384], ["triton_2kernel", "triton_atomic_recompute", "sdpa_flash"])
    assert "triton_atomic_recompute fwd/bwd" in header.splitlines()[0]


def test_a_variant_runs_in_the_grid_under_its_label(tmp_path):
    out = tmp_path / "variants.csv"
    argv = [*TINY, "--N", "64", "--B", "1", "--H", "1", "--causal", "yes", "--mode", "fwd"]
    assert run.main([*argv, "--impl", "numpy_ref,numpy_ref:block_m=16,block_n=16", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in read_csv(out)}
    assert set(rows) == {"numpy_ref", "numpy_ref:block_m=16,block_n=16"}
    assert all(r["status"] == "ok" for r in rows.values())
    # The variant's own blocks: 16 x 16 tiles at N = 64 causal skip 6 of 16, 64 x 64 tiles skip none.
    assert rows["numpy_ref:block_m=16,block_n=16"]["skip_ratio"] == 6 / 16
    assert rows["numpy_ref"]["skip_ratio"] == 0.0


def test_decode_plot_draws_one_panel_per_timing_mode_nq_and_layout(tmp_path):
    """The decoding benchmark's figure comes from its CSV alone (no GPU): eager and graph rows, both layouts."""
    from attnzoo.bench import decode

    csv_path = tmp_path / "decode.csv"
    rows = [
        dict(impl=impl, mode=mode, B=b, Nq=1, cache=4096, layout=layout, ms="0.5", GBps="100", of_copy="0.3")
        for impl in ("triton_splitk", "sdpa_flash")
        for mode in decode.MODES
        for b in (1, 8)
        for layout in ("dense", "paged")
    ]
    decode._write(rows, csv_path)
    png = tmp_path / "decode.png"
    decode.plot(csv_path, png)
    assert png.stat().st_size > 10_000


def test_decode_bench_compiles_flex_with_room_for_every_shape(monkeypatch):
    """FlexAttention is compiled once per shape of the decoding grid (up to 18; the bench takes the grid benchmark's
    compiled Flex); past Dynamo's recompile limit it would run its unfused eager fallback, which is not the kernel
    being compared, so the limit is raised."""
    import torch._dynamo
    import torch._functorch.config

    monkeypatch.setattr(impls, "_compiled_flex", None)
    grid_shapes = len([1, 8, 64]) * len([4096, 32768, 131072]) * len([1, 4])
    # The configs' own patch() restores them afterwards (pytest's monkeypatch would delete, and so hide, an entry).
    with (
        torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256),
        torch._functorch.config.patch(donated_buffer=True),
    ):
        impls._flex()
        assert torch._dynamo.config.recompile_limit >= grid_shapes
