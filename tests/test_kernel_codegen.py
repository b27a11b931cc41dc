"""What the compiler makes of the Triton kernels for the H100 (sm_90a), checked without a GPU.

``bench/ptx_report.py`` compiles a kernel config as a launch would specialise it and reads its PTX. When the head
dim equals its tile (D = 128), every output tile must leave the kernel in 16-byte vector stores and the atomic
backward's dK/dV in 4-wide float32 reductions: a column mask against the runtime head dim once made them 2-byte
stores and scalar reductions, which cost the forward up to 1.25x at N = 1k and the atomic backward 2x on the H100
(docs/design.md). Runs in a subprocess, because the rest of the suite uses the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ptx_report(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ptx_report.py"), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas")
    if proc.returncode != 0 and "unexpected keyword argument 'constexprs'" in proc.stderr:
        pytest.skip("ptx_report compiles through the ASTSource API of Triton 3.4 and later")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # ptxas serialises every wgmma of a kernel (waits for each product as it issues it) where it does not see that no
    # other instruction touches an in-flight product's accumulator: an `if` around an asynchronous product, or "one
    # outstanding" waited across a loop's back edge, did so without any error.  The report prints ptxas's notices
    # (and any warning) under the config's line.
    serialised = [f"{config}\n{notice}" for config, notice in itertools.pairwise(lines) if "Performance Loss" in notice]
    assert not serialised, "\n".join(serialised)
    return [line for line in lines if not line.lstrip().startswith("ptxas:")]


def test_outputs_leave_every_kernel_in_16_byte_stores():
    lines = _ptx_report("--kernel", "forward,dkdv,dq,atomic", "--d", "128", "--config", "64,64,4,3")
    assert len(lines) == 4
    for line in lines:
        stores = re.search(r"stores (\S+(?: \S+)*?), reductions (.*?), wgmma waits", line)
        assert stores, line
        store_widths = {w.split("x", 1)[1] for w in stores.group(1).split()}
        # The per-row lse (float32, one value per row) is the only scalar store allowed.
        assert store_widths <= {".v4.b32", ".b32"} and ".v4.b32" in store_widths, line
        if line.startswith("atomic"):
            assert {w.split("x", 1)[1] for w in stores.group(2).split()} == {".v4.f32"}, line


def _config_flags(cfg) -> str:
    """A candidate as ``bench/ptx_report.py --config`` takes it."""
    flags = ",".join(map(str, (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)))
    return flags + (",gluon" if cfg.gluon else "") + (",persistent" if cfg.persistent else "")


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_the_gluon_kernels_keep_a_product_in_flight_during_the_softmax(kernel):
    """The Gluon Hopper kernels exist to overlap the softmax (forward) or the softmax gradient (dK/dV, dQ) with matrix
    products: their loops must wait for the wgmma groups with one still in flight ("wait 1"; the dQ kernel's loop
    with two, its dQ and dP products, while it exponentiates: "wait 2"). Spills stay out of every candidate (the
    dK/dV kernel's causal builds reached them at 255 registers until its lse2 and Delta moved to shared memory).
    The causal builds are checked: they hold the full builds' loop and the masked tiles' besides, in one register
    allocation (compiling the full builds too doubled this test's time, a sixth of the suite's).  The persistent forward
    keeps its loop over Q blocks at the 168-register limit of two warpgroups and a producer warp: this report's
    plain ptxas run spills a few words of it with the causal mask (16/24 B stored/loaded at D = 128 with two sets of
    Q slots, 12/16 B with one; bench/results/ptx_persistent_q_sets_triton39.log), where Triton 3.9's own build of
    the one-set loop (ptxas with ``--regAllocOptLevel=2``) spilled none."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from attnzoo.kernels.tuning import CANDIDATES, fits_head_dim

    for d in (64, 128):
        configs = [c for c in CANDIDATES[kernel] if c.gluon and fits_head_dim(kernel, c, d)]
        assert configs
        # One report for every config of a head dim (one process: its imports dominate a config's compile time).
        lines = _ptx_report(
            "--kernel", kernel, "--d", str(d), "--config", ";".join(map(_config_flags, configs)), "--causal"
        )
        assert len(lines) == len(configs)
        for line in lines:
            spills = re.search(r"spill (\d+)/(\d+) B", line)
            assert spills, line
            limit = 32 if " persistent:" in line else 0
            assert int(spills.group(1)) <= limit and int(spills.group(2)) <= limit, line
            waits = re.search(r"wgmma waits (.*)$", line).group(1).split()
            assert any(w.endswith("x2" if kernel == "dq" else "x1") for w in waits), line


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_the_gluon_kernels_compile_for_packed_batches(kernel):
    """The packed-batch (varlen) build of each one-block-per-program Gluon config (forward, dK/dV, dQ) compiles with
    a product kept in flight.  The zeroing of the rows past a sequence spills a few words there (the forward's
    producer warp: 8-28 B stored, once per Q block; the dQ kernel's 128-row tile at its 168 registers: a few
    words)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from attnzoo.kernels.tuning import CANDIDATES, fits_head_dim

    configs = [c for c in CANDIDATES[kernel] if c.gluon and not c.persistent and fits_head_dim(kernel, c, 128)]
    lines = _ptx_report("--kernel", kernel, "--d", "128", "--config", ";".join(map(_config_flags, configs)), "--causal",
                        "--modifiers", "varlen")  # fmt: skip
    assert len(lines) == len(configs)
    for line in lines:
        spills = re.search(r"spill (\d+)/(\d+) B", line)
        assert spills and int(spills.group(1)) <= 64 and int(spills.group(2)) <= 128, line
        in_flight = "x2" if kernel == "dq" else "x1"
        assert any(w.endswith(in_flight) for w in re.search(r"wgmma waits (.*)$", line).group(1).split()), line


def test_the_five_product_backward_adds_dq_by_tma_reductions():
    """The five-product build of the Gluon dK/dV kernel (``triton_atomic``'s Hopper path) adds each Q tile's dQ
    share by TMA reductions of a shared-memory tile, one instruction per column part (the 64-key block: one part at
    D = 64, two at D = 128; the warp-specialised block: one in each warpgroup's code, or two 32-column messages in
    each of its two dQ writer warps' where it has them) and no per-thread ``red``/``atom`` additions; and its
    shared memory stays within the estimate by which the tuner prunes candidates (an estimate without the float32
    staging tile let a candidate through that could not launch)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from attnzoo.kernels.backward_gluon import dq_writer
    from attnzoo.kernels.tuning import CANDIDATES, shared_memory_estimate

    configs = [c for c in CANDIDATES["atomic"] if c.gluon]
    assert configs
    for cfg in configs:
        flags = ",".join(map(str, (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages))) + ",gluon"
        lines = _ptx_report("--kernel", "dkdv", "--d", "64,128", "--config", flags, "--modifiers", "dq_atomic")
        for d, line in zip((64, 128), lines, strict=True):
            # The 128-key tile is warp-specialised: each warpgroup adds its own part of the share (its 64 columns
            # at D = 128, its keys' share at D = 64), one reduction each in the code of its partition, or two
            # 32-column messages in its dQ writer warp's where it has one; its registers stay within what
            # setmaxnreg gives, a few words spilled.
            specialised = cfg.num_warps == 8
            writers = specialised and dq_writer(d, causal=False, ordered=False)
            reductions = (4 if writers else 2) if specialised else d // 64
            assert re.search(r"reductions (.*?), wgmma waits", line).group(1) == f"{reductions}xtma", line
            shared = int(re.search(r"(\d+) B shared memory", line).group(1))
            assert shared <= shared_memory_estimate("atomic", cfg, d, 2), line
            assert ("setmaxnreg" in line) == specialised, line
            spills = int(re.search(r"spill (\d+)/", line).group(1))
            assert not specialised or spills <= 16, line
    # Ordered additions too: in the warp-specialised block the warpgroups' writer warps take the lock turns (two
    # staging tiles each at D = 64: its largest shared memory), the 64-key tile's warps their own.
    ordered = _ptx_report(
        "--kernel", "dkdv", "--d", "64,128", "--config", ";".join(map(_config_flags, configs)),
        "--modifiers", "dq_atomic,dq_ordered",
    )  # fmt: skip
    builds = list(itertools.product((64, 128), configs))  # the report's order: head dims, then configs
    assert len(ordered) == len(builds), ordered
    for line, (d, cfg) in zip(ordered, builds, strict=True):
        specialised = cfg.num_warps == 8
        assert not specialised or dq_writer(d, causal=False, ordered=True)
        assert ("setmaxnreg" in line) == specialised, line
        reductions = 4 if specialised else d // 64
        assert re.search(r"reductions (.*?), wgmma waits", line).group(1) == f"{reductions}xtma", line
        shared = int(re.search(r"(\d+) B shared memory", line).group(1))
        assert shared <= shared_memory_estimate("atomic", cfg, d, 2), line


def test_the_fp8_forward_multiplies_fp8_on_the_tensor_cores():
    """``attention_fp8``'s forward (DESCALE, v with its keys contiguous) runs both products as FP8 ``wgmma``
    (``f32.e4m3.e4m3``: twice the 16-bit rate on Hopper), with no spills, full and causal: the Triton kernel and
    the Gluon one (which keeps a product in flight, as in 16 bits)."""
    gluon = importlib.util.find_spec("triton.experimental.gluon") is not None
    configs = ("128,64,8,3", "64,64,4,3", "128,128,8,2", *(("128,128,8,2,gluon", "64,64,4,3,gluon") * gluon))
    for causal in ((), ("--causal",)):
        lines = _ptx_report(
            "--kernel", "forward", "--dtype", "fp8", "--d", "128", "--config", ";".join(configs), *causal
        )
        assert len(lines) == len(configs)
        for line in lines:
            products = re.search(r"products (.*?), stores", line).group(1).split()
            assert products and all(p.endswith("xf32.e4m3.e4m3") for p in products), line
            assert re.search(r"spill 0/0 B", line), line
            if " gluon:" in line:
                assert any(w.endswith("x1") for w in re.search(r"wgmma waits (.*)$", line).group(1).split()), line


def test_the_gluon_dq_kernel_needs_two_ring_slots():
    """The Gluon dQ kernel's iteration j reads K tile j - 1 (its dQ product) and tile j (S): a one-slot ring would wait
    forever on the GPU, so its launcher refuses it before anything runs."""
    import torch

    from attnzoo.kernels.backward_gluon_dq import attention_dq_hopper

    x, stats = torch.randn(1, 1, 64, 64), torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="num_stages=1"):
        attention_dq_hopper(x, x, x, x, x, stats, stats, stats, x, 0.1, False, None, num_stages=1)


def test_the_warp_specialised_forward_holds_a_256_column_o_above_the_launch_registers():
    """Gluon's warp specialisation raises the computing warpgroups to 248 and 232 registers and lowers the producer
    warp's to 24 (``setmaxnreg``), above the 168 a thread of the 384 gets at launch: the forward's 128 x 64 tile at
    D = 256 (a 64 x 256 float32 O per warpgroup, 128 registers a thread) uses more than 168 in its SASS, without
    spills, full and causal; its packed build too, but for a few words (the producer warp zeroes a sequence's last
    V tile past its end in 128-column halves within its 24 registers: 4-80 B in Triton 3.6's and 3.9's ptxas)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    for flags in ((), ("--causal",), ("--causal", "--modifiers", "varlen")):
        (line,) = _ptx_report("--kernel", "forward", "--d", "256", "--config", "128,64,8,2,gluon", *flags)
        found = re.search(r"(\d+) registers \(setmaxnreg ([\d/]+); (\d+) used in the code\)", line)
        assert found, line
        launch, counts, used = int(found.group(1)), {int(n) for n in found.group(2).split("/")}, int(found.group(3))
        assert launch == 168 and {24, 232, 248} <= counts and launch < used <= 232, line
        limit = 128 if "varlen" in flags else 0
        spills = re.search(r"spill (\d+)/(\d+) B", line)
        assert spills and int(spills.group(1)) <= limit and int(spills.group(2)) <= limit, line


@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_the_wide_backward_kernels_split_the_head_dim_between_warpgroups(kernel, dims):
    """The dQ and dK/dV kernels above D = 128 (``backward_gluon_wide.py``: D = Dv = 256, and D = 192 with Dv = 128)
    split the head dim between two warpgroups, which ``setmaxnreg`` raises to 240 registers above the 168 of the
    launch (the D = 192 dQ kernel's code uses fewer): full and causal builds, with and without a window's left
    edge, and with the soft cap and ALiBi, compile, their products unserialised (``_ptx_report``), without spills
    but for a few words of the D = 256 dQ kernel (112-128 B in Triton 3.9's ptxas) and of the D = 256 dK/dV kernel
    with all three modifiers and no causal mask (28 B); packed builds too, whose producer warp zeroes a sequence's
    tail rows in its 24 registers, 128 columns at a time (16-60 B of spills; 140-168 B in the D = 256 dQ kernel)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    d, dv = dims
    builds = [
        *itertools.product(((), ("--causal",)), ((), ("--modifiers", "window"))),
        ((), ("--modifiers", "softcap,alibi")),
        ((), ("--modifiers", "softcap,alibi,window")),
        (("--causal",), ("--modifiers", "softcap,alibi,window")),
        (("--causal",), ("--modifiers", "varlen")),
    ]
    for causal, modifiers in builds:
        (line,) = _ptx_report(
            "--kernel", kernel, "--d", str(d), "--dv", str(dv), "--config", "64,64,4,2,gluon", *causal, *modifiers
        )  # fmt: skip
        found = re.search(r"(\d+) registers \(setmaxnreg ([\d/]+); (\d+) used in the code\)", line)
        assert found, line
        launch, counts, used = int(found.group(1)), {int(n) for n in found.group(2).split("/")}, int(found.group(3))
        assert launch == 168 and {24, 240} <= counts and used <= 240, line
        assert used > launch or (kernel, d) == ("dq", 192), line  # (D = 192's dQ half fits the launch's count)
        spills = re.search(r"spill (\d+)/(\d+) B", line)
        if modifiers and "varlen" in modifiers[-1]:
            # a packed batch's tail tiles, zeroed by the producer warp in its 24 registers
            limit = 192 if (kernel, d) == ("dq", 256) else 64
        elif (kernel, d) == ("dq", 256):
            limit = 128
        elif (kernel, d, causal, modifiers) == ("dkdv", 256, (), ("--modifiers", "softcap,alibi,window")):
            limit = 32
        else:
            limit = 0
        assert spills and int(spills.group(1)) <= limit and int(spills.group(2)) <= limit, line


def test_the_wide_backward_kernels_take_their_one_tile_shape():
    """The kernels above D = 128 are built for D = Dv = 256 and D = 192 with Dv = 128, in 64 x 64 tiles and two ring
    slots (at D = 256 a third 64 KB slot would not fit the shared memory): their launchers refuse anything else
    before anything runs."""
    import torch

    from attnzoo.kernels.backward_gluon_wide import attention_dkdv_wide_hopper, attention_dq_wide_hopper

    x, stats = torch.randn(1, 1, 64, 256), torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="num_stages=3"):
        attention_dkdv_wide_hopper(x, x, x, x, stats, stats, x, x, 0.1, False, num_stages=3)
    with pytest.raises(ValueError, match="block_n=128"):
        attention_dq_wide_hopper(x, x, x, x, x, stats, stats, stats, x, 0.1, False, block_n=128)
    narrow = torch.randn(1, 1, 64, 128)
    with pytest.raises(ValueError, match="D = 128, Dv = 128"):
        attention_dq_wide_hopper(narrow, narrow, narrow, narrow, narrow, stats, stats, stats, narrow, 0.1, False)
    square = torch.randn(1, 1, 64, 192)  # D = Dv = 192: v's columns would not split into the kernels' halves
    with pytest.raises(ValueError, match="D = 192, Dv = 192"):
        attention_dkdv_wide_hopper(square, square, square, square, stats, stats, square, square, 0.1, False)
