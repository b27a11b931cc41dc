"""attnzoo: exact attention, from a readable NumPy reference to fast Triton kernels, behind one interface.

>>> import attnzoo
>>> attnzoo.names()                       # every registered backend
>>> o, lse = attnzoo.get("torch_fa2").forward(q, k, v, causal=True)
>>> o = attnzoo.attention(q, k, v, causal=True)   # autograd, torch.compile-able
>>> o = attnzoo.sdpa(q, k, v, is_causal=True)     # scaled_dot_product_attention's exact signature and semantics
>>> o, lse = attnzoo.merge_attention(o_parts, lse_parts)  # results over disjoint key sets -> their union
>>> o = attnzoo.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new)  # decoding, in-place append
>>> o = attnzoo.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)  # packed variable-length batches
>>> o = attnzoo.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale)  # float8_e4m3fn inputs, bf16 output
"""

from . import backends as _backends  # noqa: F401  (registers every backend)
from .autograd import attention, pick_backend
from .backend import REQUIRED_FEATURES, Backend, Capabilities, get, names
from .drop_in import sdpa, sdpa_patched
from .fp8 import attention_fp8
from .kvcache import attention_with_kvcache
from .merge import merge_attention
from .validation import Problem
from .varlen import attention_varlen

__all__ = [
    "REQUIRED_FEATURES",
    "Backend",
    "Capabilities",
    "Problem",
    "attention",
    "attention_fp8",
    "attention_varlen",
    "attention_with_kvcache",
    "get",
    "merge_attention",
    "names",
    "pick_backend",
    "sdpa",
    "sdpa_patched",
]
__version__ = "0.1.0"
