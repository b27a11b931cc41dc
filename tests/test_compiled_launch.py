"""``kernels/compiled_launch.py``: a keyed launch reaches the compiled kernel that its key's first launch found, with
the arguments in the kernel's order, and only where the caller named a key; on the CPU with a stand-in kernel (the
Triton interpreter compiles nothing), on the GPU through every launch of the GPU tests (``ATTNZOO_CHECK_LAUNCHES``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from attnzoo.kernels import compiled_launch

TRITON_PATH_NEEDED = compiled_launch._triton_path_needed


def kernel_body(x_ptr, n, scale=2.0, BLOCK: int = 16):  # the stand-in's signature, as a @triton.jit function's
    pass


class StandInKernel:
    """What compiled_launch uses of a JIT function: ``fn``, ``kernel[grid](...)`` (returns the compiled kernel) and
    ``warmup``; it records Triton's launches and the compiled kernel's."""

    def __init__(self) -> None:
        self.fn = kernel_body
        self.compiled = SimpleNamespace(
            name="kernel_body", function=7, packed_metadata=("meta",), run=self.run_compiled
        )
        self.bound_launches: list = []
        self.compiled_launches: list = []
        self.found = self.compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.bound_launches.append((grid, args, kwargs))
            return self.compiled

        return launch

    def warmup(self, *args, grid, **kwargs):
        return self.found

    def run_compiled(self, *args):
        self.compiled_launches.append(args)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(compiled_launch, "_COMPILED", {})
    monkeypatch.setattr(compiled_launch, "DIRECT_LAUNCHES", True)  # the stand-in keeps Triton 3.6's convention
    monkeypatch.setattr(compiled_launch, "_triton_path_needed", lambda kernel: False)
    device = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda index: 1234)
    monkeypatch.setattr(compiled_launch, "driver", SimpleNamespace(active=device))
    monkeypatch.setattr(compiled_launch, "CHECK_LAUNCHES", False)
    return StandInKernel()


def test_a_keyed_launch_goes_through_triton_once_then_to_the_compiled_kernel(stand_in):
    compiled_launch.launch(stand_in, (5,), ("call", 1), "x", 10, BLOCK=32, num_warps=4)
    assert len(stand_in.bound_launches) == 1 and not stand_in.compiled_launches
    compiled_launch.launch(stand_in, (6, 2), ("call", 1), "y", 11, BLOCK=32, num_warps=4)
    assert len(stand_in.bound_launches) == 1
    # grid (z = 1), stream, function, metadata, no launch metadata or hooks, then every argument in the signature's
    # order with its default filled in; the launch options are not arguments.
    assert stand_in.compiled_launches == [(6, 2, 1, 1234, 7, ("meta",), None, None, None, "y", 11, 2.0, 32)]


def test_another_key_or_other_keyword_arguments_go_through_triton(stand_in):
    compiled_launch.launch(stand_in, (1,), "a", "x", 10, BLOCK=32, num_warps=4)
    compiled_launch.launch(stand_in, (1,), "b", "x", 10, BLOCK=32, num_warps=4)
    compiled_launch.launch(stand_in, (1,), "a", "x", 10, BLOCK=64, num_warps=4)
    compiled_launch.launch(stand_in, (1,), "a", "x", 10, BLOCK=32, num_warps=8)
    assert len(stand_in.bound_launches) == 4 and not stand_in.compiled_launches


def test_a_launch_without_a_key_always_goes_through_triton(stand_in):
    for _ in range(3):
        compiled_launch.launch(stand_in, (1,), None, "x", 10)
    assert len(stand_in.bound_launches) == 3 and not stand_in.compiled_launches


@pytest.mark.parametrize("key", [None, "a"])
def test_every_launch_asks_for_fp_fusion(stand_in, key):
    """The kernels' one-FFMA steps (exp2's argument per score) need ptxas to contract a multiply and an add, which
    Triton 3.10 stops doing unless asked."""
    compiled_launch.launch(stand_in, (1,), key, "x", 10, BLOCK=32, num_warps=4)
    assert stand_in.bound_launches == [((1,), ("x", 10), {"BLOCK": 32, "num_warps": 4, "enable_fp_fusion": True})]


def test_the_check_fails_a_key_under_which_triton_would_find_another_kernel(stand_in, monkeypatch):
    monkeypatch.setattr(compiled_launch, "CHECK_LAUNCHES", True)
    compiled_launch.launch(stand_in, (1,), "a", "x", 10)
    compiled_launch.launch(stand_in, (1,), "a", "x", 10)  # Triton finds the same kernel: launched
    stand_in.found = SimpleNamespace(name="another specialisation")
    with pytest.raises(AssertionError, match="does not fix its specialisation"):
        compiled_launch.launch(stand_in, (1,), "a", "x", 16)
    assert len(stand_in.compiled_launches) == 1


def test_launches_go_through_triton_where_its_launch_convention_was_not_read(stand_in, monkeypatch):
    monkeypatch.setattr(compiled_launch, "DIRECT_LAUNCHES", False)
    for _ in range(3):
        compiled_launch.launch(stand_in, (1,), "a", "x", 10)
    assert len(stand_in.bound_launches) == 3 and not stand_in.compiled_launches


@pytest.mark.parametrize("hook", ["launch hook", "pre-run hook"])
def test_a_registered_hook_sends_launches_through_triton(stand_in, monkeypatch, hook):
    """A launch hook (a profiler) takes metadata that only Triton's path builds; a pre-run hook runs only there."""
    if compiled_launch.knobs is None:
        pytest.skip("Triton before 3.4 has no launch hook chains")
    monkeypatch.setattr(compiled_launch, "_triton_path_needed", TRITON_PATH_NEEDED)
    assert not compiled_launch._triton_path_needed(stand_in)
    if hook == "launch hook":
        monkeypatch.setattr(compiled_launch.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    else:
        stand_in.pre_run_hooks = [lambda *args, **kwargs: None]
    for _ in range(2):
        compiled_launch.launch(stand_in, (1,), "a", "x", 10)
    assert len(stand_in.bound_launches) == 2 and not stand_in.compiled_launches
