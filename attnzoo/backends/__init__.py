"""The backends; importing this package registers each of them (registration order is the table order)."""

from . import numpy_ref, torch_fa1, torch_fa2, triton_2kernel, triton_atomic  # noqa: F401
