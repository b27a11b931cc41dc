"""Compile one kernel config for the H100 (sm_90a) on a machine without a GPU, and report what the compiler made.

Triton's compiler and the ``ptxas`` it ships need no GPU: this builds the PTX of a kernel of ``attnzoo/kernels``
with the specialisation a launch would get (strides of 1 become constants, pointers and row strides 16-byte
aligned, sizes not specialised), runs ``ptxas -v`` on it, and prints registers per thread, spill bytes, the
widths of the global stores and reductions, and under them ptxas's notice where it serialises a kernel's ``wgmma``
products (and any ptxas warning). Spills, 2-byte stores and serialised products are what made kernels slow on the
H100 (docs/design.md), and all three show here without device time. The local Triton may be newer than the
device's, so the numbers are a guide; timings still come from the GPU.

    python bench/ptx_report.py --kernel dkdv --d 128 --config 64,128,8,3
    python bench/ptx_report.py --kernel forward,dkdv,dq,atomic --d 64,128 --causal
    python bench/ptx_report.py --kernel dq --d 128 --config "128,64,8,3,gluon;64,64,4,2,gluon"
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("ptx_report compiles real kernels: unset TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnzoo.kernels.backward_2kernel import dkdv_kernel, dq_kernel
from attnzoo.kernels.backward_atomic import atomic_backward_kernel
from attnzoo.kernels.forward import attention_forward_kernel
from attnzoo.kernels.gluon_hopper import gluon_unavailable_reason
from attnzoo.kernels.launch import folds_scale
from attnzoo.kernels.tuning import CANDIDATES, KernelConfig, head_dim_tile

KERNELS = {"forward": attention_forward_kernel, "dkdv": dkdv_kernel, "dq": dq_kernel, "atomic": atomic_backward_kernel}
TARGET = GPUTarget("cuda", 90, 32)
# The H100's shared memory per CTA (bytes; Triton's max_shared_mem there).
H100_SHARED_MEMORY = 232_448
DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "fp8": "fp8e4nv"}
FLOAT32_POINTERS = ("lse_ptr", "lse2_ptr", "delta_ptr", "dk_acc_ptr", "dv_acc_ptr", "alibi_ptr", "descale_ptr")
INT32_POINTERS = ("seqlens_ptr", "counts_ptr", "cu_seqlens_q", "cu_seqlens_k", "dq_locks_ptr")
SCALARS = ("sm_scale", "qk_scale", "cap_in", "cap_out")


def _ptxas() -> str:
    """The ptxas that Triton itself runs for sm_90 (named ptxas-blackwell in Triton >= 3.5)."""
    from triton.backends.nvidia import compiler

    tool = compiler.get_ptxas(90) if hasattr(compiler, "get_ptxas") else triton.knobs.nvidia.ptxas
    return tool.path


def _nvdisasm() -> str:
    """The disassembler beside that ptxas (Triton ships both)."""
    return os.path.join(os.path.dirname(_ptxas()), "nvdisasm")


def source(
    kernel, dtype: str, d: int, cfg: KernelConfig, causal: bool, q_tail: bool, modifiers: frozenset[str] = frozenset()
) -> ASTSource:
    """The kernel as a launch on contiguous ``[B, H, N, d]`` tensors of ``dtype`` would specialise it; ``modifiers``:
    "window" (a left bound, as causal sliding windows have), "softcap" (the GPU's fp16/bf16 form), "alibi", "varlen"
    (a packed batch: the masked stage and Q-side row predicates always, no TMA)."""
    block_d = head_dim_tile(d)
    plain = not {"softcap", "alibi"} & modifiers and dtype != "fp8"
    varlen = "varlen" in modifiers
    fp8 = dtype == "fp8"  # attention_fp8: its descale factors, o in bfloat16, v stored with the keys contiguous
    flags = dict(
        EVEN_D=d == block_d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        HAS_SEQLENS=False, DOT_PRECISION="ieee", DEBUG=False, Q_TAIL=q_tail or varlen, DELTA_RECOMPUTE=False,
        FOLD_SCALE=folds_scale(1.0, block_d) and plain, MASK_STAGE=causal or varlen,  # as for N % 128 == 0
        USE_TMA=cfg.tma and not (varlen or fp8), VARLEN=varlen, BLOCK_DV=block_d, EVEN_DV=d == block_d, DV_IS_D=True,
        WINDOW_LEFT="window" in modifiers,
        WINDOW_RIGHT=False, SOFTCAP=2 if "softcap" in modifiers else 0, ALIBI="alibi" in modifiers, DESCALE=fp8,
    )  # fmt: skip
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in flags:
            signature[name], constexprs[(i,)] = "constexpr", flags[name]
        elif fp8 and name in ("stride_vn", "stride_vd"):  # FP8's v has the keys contiguous (P V's K-major operand)
            if name == "stride_vn":
                signature[name], constexprs[(i,)] = "constexpr", 1
            else:
                signature[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        elif name.startswith("stride") and name.endswith("d"):  # the head-dim stride of a contiguous tensor
            signature[name], constexprs[(i,)] = "constexpr", 1
        elif name == "o_ptr" and fp8:
            signature[name], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        elif name.endswith("_desc"):  # the forward's K/V: a [1, 1, BLOCK_N, BLOCK_D] box, or an unused pointer
            box = f"1, 1, {cfg.block_n}, {block_d}"
            signature[name] = f"tensordesc<{DTYPES[dtype]}[{box}]>" if cfg.tma else f"*{DTYPES[dtype]}"
        elif name.endswith("_ptr") or name in INT32_POINTERS:
            elem = "fp32" if name in FLOAT32_POINTERS else "i32" if name in INT32_POINTERS else DTYPES[dtype]
            signature[name], attrs[(i,)] = f"*{elem}", [["tt.divisibility", 16]]
        elif name in SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") and "alibi" not in name:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def gluon_source(
    kernel_name: str,
    dtype: str,
    d: int,
    cfg: KernelConfig,
    causal: bool,
    modifiers: frozenset[str] = frozenset(),
    dv: int | None = None,
):
    """A Gluon Hopper kernel (a ``gluon`` config of the forward, the dK/dV or the dQ kernel) as its launcher
    (``forward_gluon.attention_forward_hopper``, ``backward_gluon.attention_dkdv_hopper``,
    ``backward_gluon_dq.attention_dq_hopper``) specialises it, and the ``num_warps`` it launches with: descriptors of
    ``[1, 1, rows, d]`` boxes (q/k in two column parts where the forward's D is not a power of two, and in the parts
    128 + (D - 128) for the backward kernels above D = 128, ``backward_gluon_wide``); the forward's and the dQ
    kernel's q/o/dO/dQ boxes hold one warpgroup's 64 rows, the dK/dV kernel's q/dO boxes BLOCK_M rows, and every
    k/v/dK/dV box BLOCK_N (64 in the warp-specialised dK/dV block).  ``dv``: the value head dim of the forward and of
    the backward above D = 128 (v, o, dO and dV boxes; None: ``d``).  ``dtype`` "fp8" (the forward only): e4m3
    q/k/v boxes, v's as ``[1, 1, Dv, BLOCK_N]`` boxes of its keys-contiguous view, o in bfloat16 (DESCALE)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from attnzoo.kernels.backward_gluon import (
        attention_dkdv_hopper_kernel,
        dkdv_warp_specialized,
        dq_share_width,
        dq_writer,
    )
    from attnzoo.kernels.backward_gluon_dq import attention_dq_hopper_kernel
    from attnzoo.kernels.backward_gluon_wide import (
        WIDE_HEAD_DIMS,
        attention_dkdv_wide_kernel,
        attention_dq_wide_kernel,
        wide_head_dim_parts,
    )
    from attnzoo.kernels.forward_gluon import KERNEL_WARPS, attention_forward_hopper_kernel

    dv = d if dv is None else dv
    wide = kernel_name != "forward" and d > 128  # q, k and their gradients in two parts of 128 + (D - 128)
    if wide and (kernel_name == "atomic" or (d, dv) not in WIDE_HEAD_DIMS):
        raise SystemExit(
            f"{kernel_name} at D={d} Dv={dv}: above D = 128 the Gluon backward is backward_gluon_wide's dK/dV and dQ "
            f"kernels, for (D, Dv) in {WIDE_HEAD_DIMS} (the five-product kernel stops at 128)"
        )
    if kernel_name == "forward":
        kernel, q_rows, num_warps = attention_forward_hopper_kernel, 64, KERNEL_WARPS
    elif kernel_name == "dq" and d > 128:  # the head-dim-split kernel (backward_gluon_wide)
        kernel, q_rows, num_warps = attention_dq_wide_kernel, 64, KERNEL_WARPS
    elif kernel_name == "dq":
        kernel, q_rows, num_warps = attention_dq_hopper_kernel, 64, KERNEL_WARPS
    elif d > 128:  # the head-dim-split kernel (backward_gluon_wide), launched with one warpgroup
        kernel, q_rows, num_warps = attention_dkdv_wide_kernel, cfg.block_m, KERNEL_WARPS
    else:
        kernel, q_rows, num_warps = attention_dkdv_hopper_kernel, cfg.block_m, cfg.num_warps
    warp_specialized = kernel_name == "dkdv" and dkdv_warp_specialized(cfg.num_warps)
    if warp_specialized:  # launched with the default partition's warpgroup; k/v boxes of one warpgroup's keys
        num_warps = KERNEL_WARPS

    from attnzoo.kernels.gluon_hopper import dq_stage_slots, head_dim_parts

    d_first, d_second = head_dim_parts(d) if kernel_name == "forward" else wide_head_dim_parts(d) if wide else (d, 0)

    fp8 = dtype == "fp8"
    # The five-product block's dQ writer warps, as attention_dkdv_hopper launches them.
    writer = warp_specialized and "dq_atomic" in modifiers and dq_writer(d, causal, "dq_ordered" in modifiers)

    def descriptor(rows: int, width: int, name: str) -> str:
        box = [1, 1, rows, width]
        element = "bf16" if fp8 and name == "o_desc" else dtype
        gl_dtype = {"fp16": gl.float16, "bf16": gl.bfloat16, "fp8": gl.float8e4nv}[element]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
        return f"tensordesc<{DTYPES[element]}[{', '.join(map(str, box))}],{layout!r}>"

    softcap = "softcap" in modifiers
    from attnzoo.kernels import forward_gluon as forms

    if softcap and kernel_name == "forward" and hasattr(forms, "SOFTCAP_FIXED_MAX"):
        # The form attention_forward_hopper takes for a cap of 30 (``softcap_form``); a tree from before the fixed
        # max (an A/B's reference, on PYTHONPATH) has none and takes the flag.
        fixed = dtype == "bf16" and "alibi" not in modifiers
        softcap = forms.SOFTCAP_FIXED_MAX if fixed else forms.SOFTCAP_RUNNING_MAX
    q_sets = 1
    if kernel_name == "forward" and cfg.persistent and hasattr(forms, "persistent_q_sets"):
        itemsize = 1 if fp8 else 2
        q_sets = forms.persistent_q_sets(d, dv, cfg.block_n, cfg.num_stages, itemsize, H100_SHARED_MEMORY)
    flags = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=d_first, BLOCK_D2=d_second, BLOCK_DV=dv,
                 CAUSAL=causal, NUM_STAGES=cfg.num_stages, IS_FP16=dtype == "fp16", NUM_WARPGROUPS=cfg.block_m // 64,
                 WINDOW_LEFT="window" in modifiers, WINDOW_RIGHT=False, SOFTCAP=softcap,
                 ALIBI="alibi" in modifiers, PERSISTENT=cfg.persistent, VARLEN="varlen" in modifiers,
                 DESCALE=fp8, DQ_ATOMIC="dq_atomic" in modifiers, DQ_ORDERED="dq_ordered" in modifiers,
                 WARP_SPECIALIZED=warp_specialized, DQ_WRITER=writer,
                 DQ_STAGE_SLOTS=dq_stage_slots(d, writer), Q_SETS=q_sets)  # fmt: skip
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in flags:
            signature[name], constexprs[(i,)] = "constexpr", flags[name]
        elif name == "dq_desc" and flags["DQ_ATOMIC"]:  # the five-product dQ accumulator: float32 share boxes
            box = [1, 1, cfg.block_m, dq_share_width(d)]
            layout = gl.NVMMASharedLayout.get_default_for(box, gl.float32)
            signature[name] = f"tensordesc<fp32[{', '.join(map(str, box))}],{layout!r}>"
        elif name.endswith("_desc"):
            rows = q_rows if name in ("q_desc", "q2_desc", "o_desc", "do_desc", "dq_desc", "dq2_desc") else cfg.block_n
            rows = 64 if warp_specialized and name in ("k_desc", "v_desc", "dk_desc", "dv_desc") else rows
            second = d_second or d_first
            width = {"v_desc": dv, "o_desc": dv, "do_desc": dv, "dv_desc": dv, "q2_desc": second, "k2_desc": second,
                     "dk2_desc": second, "dq2_desc": second}  # fmt: skip
            if fp8 and name == "v_desc":  # v keys-contiguous: Dv rows of BLOCK_N keys
                signature[name] = descriptor(dv, cfg.block_n, name)
            else:
                signature[name] = descriptor(rows, width.get(name, d_first), name)
        elif name in ("o_ptr", "dk_ptr", "dv_ptr", "dq_ptr", "do_ptr"):  # packed outputs, the dQ kernel's o and do
            signature[name] = "*bf16" if fp8 else f"*{DTYPES[dtype]}"
        elif name.endswith("_ptr") or name in INT32_POINTERS:
            signature[name] = "*i32" if name in INT32_POINTERS else "*fp32"
        else:
            signature[name] = "fp32" if name in SCALARS else "i32"
    return GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs), num_warps


def report(
    kernel_name: str, dtype: str, d: int, cfg: KernelConfig, causal: bool, q_tail: bool,
    modifiers: frozenset[str] = frozenset(), dv: int | None = None,
) -> dict:  # fmt: skip
    """Registers, shared memory, spill bytes, global store / reduction widths and the wgmma waits of one compiled
    config."""
    if dv not in (None, d) and not (cfg.gluon and (kernel_name == "forward" or d > 128)):
        raise SystemExit("--dv: the Gluon forward and the D > 128 backward only (the others' reports take Dv = D)")
    if cfg.gluon:
        if gluon_unavailable_reason():
            raise SystemExit(gluon_unavailable_reason())
        src, num_warps = gluon_source(kernel_name, dtype, d, cfg, causal, modifiers, dv)
    else:
        src, num_warps = source(KERNELS[kernel_name], dtype, d, cfg, causal, q_tail, modifiers), cfg.num_warps
    compiled = triton.compile(
        src, target=TARGET, options=dict(num_warps=num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True)
    )
    ptx = compiled.asm["ptx"]
    path = f"/tmp/attnzoo_{kernel_name}_{os.getpid()}.ptx"
    with open(path, "w") as fh:
        fh.write(ptx)
    cubin = path[: -len(".ptx")] + ".cubin"
    try:
        out = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", path, "-o", cubin], capture_output=True)
        sass = subprocess.run([_nvdisasm(), "-c", cubin], capture_output=True).stdout.decode()
    finally:
        for file in (path, cubin):
            if os.path.exists(file):
                os.remove(file)
    text = out.stdout.decode() + out.stderr.decode()

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else -1

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stores=collections.Counter(re.findall(r"\bst\.global((?:\.v\d)?\.[bf]\d+)", ptx)),
        # The tensor-core products by accumulator and operand types, e.g. "f32.e4m3.e4m3" (FP8), "f32.f16.f16".
        products=collections.Counter(
            re.findall(r"\bwgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.(\w+\.\w+\.\w+)", ptx)
        ),
        # Asynchronous products waited for with some still in flight ("wait 1") are what overlaps the softmax.
        mma_waits=collections.Counter(re.findall(r"\bwgmma\.wait_group\.sync\.aligned (\d+)", ptx)),
        # Warp-specialised kernels: ptxas reports the launch count (65536 registers over all threads), but
        # `setmaxnreg` raises the consumer partitions above it, and the code there uses what the SASS names.
        maxnreg=sorted({int(n) for n in re.findall(r"\bsetmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        registers_in_code=1 + max((int(n) for n in re.findall(r"\bR(\d+)\b", sass)), default=-1),
        # SASS instructions in the kernel's code, and those on the multi-function unit (exp2, tanh, reciprocals):
        # a count of the work per tile, since every loop body appears once per copy the compiler made of it.
        sass_instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M)),
        mufu=collections.Counter(re.findall(r"\bMUFU\.(\w+)", sass)),
        # Per-thread reductions by width, and the TMA reductions of a shared-memory tile ("tma": its element type is
        # in the tensor map, not the instruction).
        reductions=collections.Counter(re.findall(r"\bred\.global(?:\.\w+)*?\.add((?:\.v\d)?\.[bf]\d+)", ptx))
        + collections.Counter("tma" for _ in re.finditer(r"\bcp\.reduce\.async\.bulk\.tensor\.", ptx)),
        shared_bytes=compiled.metadata.shared,
        # "Potential Performance Loss: wgmma.mma_async instructions are serialized" (an info line, not a warning):
        # ptxas waits for each product as it issues it.
        ptxas_notices=[line.strip() for line in text.splitlines() if "warning" in line or "Performance Loss" in line],
    )


def parse_config(text: str) -> KernelConfig:
    """``BLOCK_M,BLOCK_N,warps,stages[,tma|,gluon[,persistent]]`` -> KernelConfig."""
    fields = text.split(",")
    flags = fields[4:]
    return KernelConfig(
        *map(int, fields[:4]), tma="tma" in flags, gluon="gluon" in flags, persistent="persistent" in flags
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="forward,dkdv,dq", help="comma list of " + ", ".join(KERNELS))
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--d", default="128", help="head dims, comma list")
    parser.add_argument(
        "--config",
        help="BLOCK_M,BLOCK_N,warps,stages[,tma|,gluon], several separated by ';' (default: every candidate)",
    )
    parser.add_argument(
        "--dv", type=int, help="the value head dim of the Gluon forward and the D > 128 backward kernels (default: D)"
    )
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--q-tail", action="store_true", help="dkdv: Nq not a multiple of BLOCK_M")
    parser.add_argument(
        "--modifiers",
        default="",
        help=(
            "comma list of window, softcap, alibi, varlen (the GPU's fp16/bf16 form; varlen: also the Gluon forward); "
            "dq_atomic, dq_ordered: the Gluon dK/dV kernel as the five-product backward"
        ),
    )
    args = parser.parse_args(argv)
    modifiers = frozenset(filter(None, args.modifiers.split(",")))
    for name in args.kernel.split(","):
        configs = [parse_config(c) for c in args.config.split(";")] if args.config else CANDIDATES[name]
        for d in map(int, args.d.split(",")):
            for cfg in configs:
                r = report(name, args.dtype, d, cfg, args.causal, args.q_tail, modifiers, args.dv)
                widths = lambda counts: " ".join(f"{n}x{w}" for w, n in sorted(counts.items())) or "-"  # noqa: E731
                partitions = (
                    f" (setmaxnreg {'/'.join(map(str, r['maxnreg']))}; {r['registers_in_code']} used in the code)"
                    if r["maxnreg"]
                    else ""
                )
                print(
                    f"{name} {args.dtype} D={d}{f' Dv={args.dv}' if args.dv else ''} {cfg}: "
                    f"{r['registers']} registers{partitions}, {r['shared_bytes']} B shared memory, "
                    f"spill {r['spill_stores']}/{r['spill_loads']} B stored/loaded, "
                    f"SASS {r['sass_instructions']} instructions (MUFU {widths(r['mufu'])}), "
                    f"products {widths(r['products'])}, "
                    f"stores {widths(r['stores'])}, reductions {widths(r['reductions'])}, "
                    f"wgmma waits {widths(r['mma_waits'])}",
                    flush=True,
                )
                for notice in r["ptxas_notices"]:
                    print(f"  ptxas: {notice}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
