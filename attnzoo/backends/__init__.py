"""The backends; importing this package registers each of them (registration order is the table order)."""

from . import numpy_ref  # noqa: F401
