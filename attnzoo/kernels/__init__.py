"""Triton kernels of the ``triton_2kernel`` and ``triton_atomic`` backends.

- :mod:`.common`: ``@triton.jit`` helpers shared by every kernel (pointers, masks, tile loads, the
  online-softmax step, the softmax-gradient tile, the causal/padding loop bounds).
- :mod:`.forward`: the FA2-order forward, shared by both backends.
- :mod:`.forward_gluon`: the same forward for Hopper in Gluon (Triton's lower-level language), with the softmax of
  one K/V tile overlapped with the matrix products as in FlashAttention-3; the autotuner picks it per shape.
- :mod:`.backward_2kernel`: the Q-stationary dQ kernel (which also computes Delta) and the K/V-stationary dK/dV
  kernel.
- :mod:`.backward_gluon`: that dK/dV kernel for Hopper in Gluon, its softmax-gradient arithmetic overlapped with the
  matrix products; the autotuner picks it per shape.
- :mod:`.gluon_hopper`: what the Gluon kernels share (the API of the installed Triton, the TMA ring of tiles).
- :mod:`.backward_atomic`: the Q-stationary backward whose dK/dV go through ``tl.atomic_add``, and the Delta
  preprocess kernel it may use.
- :mod:`.tuning`: the block-size/warp/stage candidates, shared-memory pruning and the autotuner.
"""
