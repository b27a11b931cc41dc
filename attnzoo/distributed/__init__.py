"""Sequence (context) parallelism over ``torch.distributed``: SPEC.md, "Sequence (context) parallelism".

>>> from attnzoo import distributed as zd
>>> q_local = zd.shard(q, layout="zigzag")        # this rank's part of dim 2 (likewise k, v)
>>> o_local = zd.ring_attention(q_local, k_local, v_local, causal=True, layout="zigzag")
>>> o = zd.unshard(o_local, layout="zigzag")      # equals attnzoo.attention(q, k, v, causal=True)

:mod:`.layout`: which chunks each rank holds; :mod:`.plan`: the local calls of each ring step; :mod:`.ring`: the
point-to-point transfers; :mod:`.attention`: the ring forward and backward and the custom operators;
:mod:`.check`: random cases against the float64 oracle (``torchrun -m attnzoo.distributed.check``).
"""

from .attention import ring_attention, shard, unshard
from .layout import LAYOUTS

__all__ = ["LAYOUTS", "ring_attention", "shard", "unshard"]
