"""Test set-up: the Triton interpreter when there is no GPU, the hypothesis profiles, a printed seed.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` kernel is defined, so it is set here, before any
test module imports attnzoo.
"""

from __future__ import annotations

import os
import random

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_per_launch() -> None:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch, not at every helper call.

    The interpreter swaps the builtins of ``tl``, ``tl.core``, ``tl.math`` and the tensor class for interpreted ones
    when a kernel launches (``_patch_lang`` in ``GridExecutor.__call__``), and again, through ``inspect.getmembers``,
    at every call of a ``@triton.jit`` helper inside the kernel: about 1.4 ms a call, over half of an interpreted
    test's time (cProfile, Triton 3.9). The launch's patches hold for its helpers (the same module objects), so while
    a launch runs, a helper's call whose language modules are patched already skips it. Triton 3.6 and later undo the
    patches when the launch ends, Triton 3.2 keeps them; both re-patch at the next launch as before. With a Triton
    whose interpreter lacks these names nothing changes; a helper that reached an unpatched builtin would fail, not
    pass."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or grid_executor is None or getattr(patch_lang, "once_per_launch", False):
        return
    no_patches = getattr(interpreter, "_LangPatchScope", lambda: None)  # what a skipped call returns (3.6+: a scope)
    launch: dict = {"running": False, "langs": None}  # the language modules (ids) the launch in progress patched

    def patch_once_per_launch(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if launch["langs"] is not None and langs <= launch["langs"]:
            return no_patches()
        scope = patch_lang(fn)
        if launch["running"]:  # the launch's own call, or a helper's from modules it had not patched (those of
            launch["langs"] = langs | (launch["langs"] or set())  # tl.zeros, say): patched until the launch ends
        return scope

    def run_launch(self, *args, launch_call=grid_executor.__call__, **kwargs):
        launch.update(running=True, langs=None)
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            launch.update(running=False, langs=None)

    patch_once_per_launch.once_per_launch = True
    interpreter._patch_lang = patch_once_per_launch
    grid_executor.__call__ = run_launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
# Every backend output is NaN-filled before its kernel runs, so an element a kernel forgets to write fails.
os.environ.setdefault("ATTNZOO_POISON_OUTPUTS", "1")
# Every launch that skips Triton's argument binding also looks its kernel up as Triton would, and fails if the
# launcher's key named another one (kernels/compiled_launch.py).
os.environ.setdefault("ATTNZOO_CHECK_LAUNCHES", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Verbosity, settings  # noqa: E402

_common = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# ci: bounded for a 2-core machine without a GPU (Triton runs in the interpreter).
settings.register_profile("ci", max_examples=100, **_common)
# dev: the default, quick runs while editing (fewer examples than ci).
settings.register_profile("dev", max_examples=40, **_common)
# gpu: more and larger examples, for `pytest -m gpu --hypothesis-profile=gpu` on the device.
settings.register_profile("gpu", max_examples=150, **_common)
settings.register_profile("debug", max_examples=10, verbosity=Verbosity.verbose, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

_seed: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Draw one hypothesis seed for the run unless --hypothesis-seed gave one, so that the header can print it.

    Under pytest-xdist (``-n``) the workers take the controller's seed from the environment, which they inherit: the
    printed seed reproduces every worker's examples."""
    global _seed
    from hypothesis import core

    if core.global_force_seed is None:
        inherited = os.environ.get("ATTNZOO_HYPOTHESIS_SEED")
        core.global_force_seed = int(inherited) if inherited else random.randrange(2**32)
    _seed = core.global_force_seed
    os.environ["ATTNZOO_HYPOTHESIS_SEED"] = str(_seed)


def pytest_report_header(config: pytest.Config) -> list[str]:
    from hypothesis import settings as current

    return [
        f"hypothesis seed: {_seed} (reproduce with --hypothesis-seed={_seed}); "
        f"profile {current.get_current_profile_name()!r}, max_examples={current.default.max_examples}",
        f"cuda: {HAS_CUDA}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
