"""Launching a compiled kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds every argument to the kernel's signature and specialises each one (its
dtype, whether a pointer is 16-byte aligned, whether an integer is 1 or a multiple of 16) to look the compiled
kernel up: on the H100 machine's host one launch of the Gluon forward (44 arguments) took 50-62 us, of which
the binding alone was 18-20 us, against 18-25 us for the same launch through ``CompiledKernel.run``
(``bench/results/h100_host_probe.log``).  A launcher that can name everything the specialisation depends on by a
key launches the kernel that the key's first launch found through ``CompiledKernel.run``, the call Triton itself
makes after the lookup and that ``CompiledKernel[grid](*args)`` makes (the same in Triton 3.6 and 3.9; with other
versions every launch binds).

The key is the caller's promise that two launches under it specialise alike.  ``launch.PreparedCall.launch_key``
names q, k, v by the prepared call's signature, which fixes every integer that follows from the problem, and any
other operand by its dtype, strides and alignment; outputs that the launchers allocate are contiguous and 16-byte
aligned (PyTorch's CUDA caching allocator aligns every block to 512 bytes); the keyword arguments (the config's
constexprs and launch options) and the current device join the key here.  Under
``ATTNZOO_CHECK_LAUNCHES=1`` (the GPU tests set it) each launch under a known key also looks its kernel up as Triton
would, and a different kernel raises.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Hashable
from typing import Any

import triton
from triton.runtime import driver

from .._env import check_launches, triton_interpreter_active

try:
    from triton import knobs
except ImportError:  # Triton before 3.4
    knobs = None


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


# Triton 3.6 and 3.9 hand the compiled kernel every bound argument, constexprs included; Triton 3.2 handed it the
# others only.  Where the convention was not read, every launch goes through ``kernel[grid]``, as under the
# interpreter (set before the kernels are defined), which compiles nothing and has no GPU driver to ask.
DIRECT_LAUNCHES = (
    knobs is not None and (3, 6) <= _version(triton.__version__) < (3, 10) and not triton_interpreter_active()
)
# Read once: the tests set ATTNZOO_CHECK_LAUNCHES before importing attnzoo.
CHECK_LAUNCHES = check_launches()

# (kernel, device, key, keyword arguments) -> (compiled kernel, the arguments' order); cleared when full.  Keyword
# values are constexprs and launch options, each site passing one type per argument (True and 1 are one dict key).
_COMPILED: dict[tuple, tuple[Any, Callable[..., tuple]]] = {}
_COMPILED_MAX = 1024
_ORDERS: dict[Any, Callable[..., tuple]] = {}


def launch(kernel: Any, grid: tuple[int, ...], key: Hashable | None, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; with a ``key`` (not None), a later launch under the same key and keyword
    arguments goes straight to the compiled kernel that the first one found.

    Every launch asks for FP fusion (``enable_fp_fusion=True``): the kernels count on ptxas contracting a multiply and
    an add into one FFMA (exp2's argument ``s * scale - m`` per score, the soft cap's ``cap_out * t - m``), Triton's
    default up to 3.9, which warns that 3.10 turns it off.  Asked for, it compiles the kernels Triton's default did
    (the same cache entries)."""
    kwargs["enable_fp_fusion"] = True
    if key is None or not DIRECT_LAUNCHES or _triton_path_needed(kernel):
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()  # the compiled kernel's function is loaded on one device
    full_key = (kernel, device, key, *kwargs.items())
    entry = _COMPILED.get(full_key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "packed_metadata"):  # a compiled kernel (the interpreter returns none)
            if len(_COMPILED) >= _COMPILED_MAX:
                _COMPILED.clear()
            _COMPILED[full_key] = (compiled, _argument_order(kernel))
        return
    compiled, order = entry
    if CHECK_LAUNCHES:  # Triton's own lookup (warmup launches nothing; it compiles only where the key was wrong)
        found = kernel.warmup(*args, grid=grid, **kwargs)
        if found is not compiled:
            raise AssertionError(f"the launch key of {compiled.name} does not fix its specialisation: {key!r}")
    stream = driver.active.get_current_stream(device)
    grid_1, grid_2 = (grid[1] if len(grid) > 1 else 1), (grid[2] if len(grid) > 2 else 1)
    compiled.run(
        grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *order(*args, **kwargs),
    )  # fmt: skip


def _triton_path_needed(kernel: Any) -> bool:
    """Whether this launch must go through ``kernel[grid]``: a launch hook (a profiler such as proton) takes metadata
    that only Triton's own path builds (Triton 3.6 and 3.9 keep the hooks in chains, empty unless something registered
    one); pre-run hooks run there; and the debug and instrumentation switches select other compiled kernels."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    if any(hook is not None and getattr(hook, "calls", True) for hook in hooks):
        return True
    if knobs.runtime.debug or knobs.compilation.instrumentation_mode:
        return True
    return bool(getattr(kernel, "pre_run_hooks", None))


def _argument_order(kernel: Any) -> Callable[..., tuple]:
    """A function of the kernel's arguments that returns their values in the signature's order, defaults filled in
    (what Triton's binder returns besides the specialisation); launch options (``num_warps``, ...) are dropped."""
    order = _ORDERS.get(kernel)
    if order is None:
        parameters = list(inspect.signature(kernel.fn).parameters.values())
        names = [p.name for p in parameters]
        header = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}=_default_{p.name}"
                           for p in parameters)  # fmt: skip
        namespace = {f"_default_{p.name}": p.default for p in parameters if p.default is not inspect.Parameter.empty}
        exec(f"def order({header}, **_options):\n    return ({''.join(n + ', ' for n in names)})", namespace)
        order = _ORDERS[kernel] = namespace["order"]
    return order
