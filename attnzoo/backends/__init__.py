"""The backends; importing this package registers each of them (registration order is the table order).

``tile_is_empty`` (with ``key_band``, the causal/window band it tests) is the tile-skipping test of the blocked
backends, public for the benchmark's skip ratio.
"""

from . import numpy_ref, torch_fa1, torch_fa2, triton_2kernel, triton_atomic, triton_splitk  # noqa: F401
from ._tiles import key_band, tile_is_empty

__all__ = ["key_band", "tile_is_empty"]
