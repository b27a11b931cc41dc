"""The process-wide switches read from the environment, in one small module that the kernels may import (the
backend interface is above them, not beside them).

- ``TRITON_INTERPRET=1``: Triton kernels run on the CPU through the interpreter (set before Triton is imported).
- ``ATTNZOO_POISON_OUTPUTS=1``: outputs start NaN-filled, so an element a kernel forgets to write fails the tests.
- ``ATTNZOO_AUTOTUNE``: ``1`` times the launch configs of every key without a stored winner (and stores the winner);
  ``0`` or unset never times (stored winners, else the heuristic pick; ``attnzoo/kernels/tuning.py``).
- ``ATTNZOO_CACHE_DIR``: where tuned winners are stored (default ``$XDG_CACHE_HOME/attnzoo``, else
  ``~/.cache/attnzoo``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def triton_interpreter_active() -> bool:
    """Whether Triton kernels run on the CPU through the interpreter (``TRITON_INTERPRET=1``)."""
    return _flag("TRITON_INTERPRET")


def poison_outputs() -> bool:
    """Whether outputs are NaN-filled before a kernel writes them (``ATTNZOO_POISON_OUTPUTS=1``, set by the tests)."""
    return _flag("ATTNZOO_POISON_OUTPUTS")


def check_launches() -> bool:
    """Whether each launch that skips Triton's argument binding is checked against Triton's own kernel lookup
    (``ATTNZOO_CHECK_LAUNCHES=1``, set by the GPU tests; ``kernels/compiled_launch.py``)."""
    return _flag("ATTNZOO_CHECK_LAUNCHES")


def autotune_requested() -> bool:
    """Whether keys without a stored winner are tuned by timing their candidates (``ATTNZOO_AUTOTUNE=1``)."""
    return _flag("ATTNZOO_AUTOTUNE")


def cache_dir() -> Path:
    """The directory of attnzoo's persistent caches: ``$ATTNZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnzoo``, else
    ``~/.cache/attnzoo``."""
    explicit = os.environ.get("ATTNZOO_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnzoo"


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised output tensor that a backend or kernel fills completely.

    Under ``ATTNZOO_POISON_OUTPUTS=1`` it starts as NaN, so that an element the kernel forgets to write
    fails the tests instead of passing with whatever the allocator left there.
    """
    if poison_outputs():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def interpreter_unusable_reason() -> str | None:
    """Why the installed Triton's interpreter cannot run kernels with the installed NumPy (None when it can).

    The interpreters of Triton 3.2 and 3.6 convert one-element arrays to Python scalars with ``int()``, which NumPy
    2.4 refuses for arrays of rank above 0 (every interpreted kernel then fails inside Triton); 3.8 squeezes the
    array first.  Releases between were not tried and are treated like their neighbours.
    """
    import triton

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())

    if version(triton.__version__) < (3, 8) and version(np.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter fails with NumPy {np.__version__} (int() of a one-element "
            "array); use NumPy < 2.4 or Triton >= 3.8"
        )
    return None
