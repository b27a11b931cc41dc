"""IO complexity of attention: HBM (DRAM) bytes of standard attention against FlashAttention, as formulas.

Counts are per call for ``B * H`` heads of ``N`` queries and ``N`` keys of head dim ``d``, in elements of the
input dtype (``elem_bytes`` each) unless noted; the softmax statistics are float32.  The cache between SRAM and
HBM (L2, 50 MB on an H100) is not modelled: these are the accesses the algorithms *issue* to HBM, which DRAM
counters can only show as an upper bound once re-reads start hitting L2.

* Standard attention (FlashAttention paper, Algorithm 0 and its backward, Dao et al. 2022, arXiv:2205.14135):
  S and P are written to and read back from HBM: Theta(N^2 + N d) per head.  ``standard_fp32_bytes`` counts the
  same accesses at 4 bytes an element: torch 2.11's SDPA math path computes fp16/bf16 inputs in float32 (its
  kernels, as ncu lists them on the H100, are float32 GEMMs between casts), so that is its model.
* FlashAttention (same paper, Algorithm 1, Theorem 2): Theta(N^2 d^2 / M) for an SRAM of M elements.  With
  column blocks ``Bc = ceil(M / 4d)`` and row blocks ``Br = min(Bc, d)``, K and V are read once and Q, O, l, m
  are read and O, l, m written once per column block: ``2Nd + Nd + 2N + Tc (3Nd + 4N)`` with ``Tc = N / Bc``,
  which is about ``12 N^2 d^2 / M``.
* FlashAttention-2 loop order (outer loop over Q row blocks of ``block_m``, as the Triton kernels here): Q read
  and O, lse written once, K and V read once per row block: ``2Nd + 4N + 2 N d * ceil(N / block_m)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# H100 SXM: up to 227 KB of shared memory per thread block (228 KB per SM); the "M" of the analysis.
H100_SRAM_BYTES = 227 * 1024
FP32_BYTES = 4


def standard_forward_elements(N: int, d: int) -> float:
    """Algorithm 0: S = Q K^T written (read 2Nd, write N^2); P = softmax(S) (read N^2, write N^2);
    O = P V (read N^2 + Nd, write Nd).  Total 4 N^2 + 4 N d elements per head."""
    return (2 * N * d + N * N) + (N * N + N * N) + (N * N + N * d + N * d)


def standard_backward_elements(N: int, d: int) -> float:
    """Standard backward from the saved P: dV = P^T dO (read N^2 + Nd, write Nd); dP = dO V^T (read 2Nd,
    write N^2); dS = P * (dP - rowsum(dP * P)) (read 2 N^2, write N^2); dQ = dS K and dK = dS^T Q (each read
    N^2 + Nd, write Nd).  Total 7 N^2 + 8 N d elements per head."""
    dv = N * N + N * d + N * d
    dp = 2 * N * d + N * N
    ds = 2 * N * N + N * N
    dq = N * N + N * d + N * d
    dk = N * N + N * d + N * d
    return dv + dp + ds + dq + dk


def flash1_forward_elements(N: int, d: int, sram_elements: float) -> float:
    """FlashAttention Algorithm 1 with SRAM of M elements: ``2Nd + Nd + 2N + Tc (3Nd + 4N)``, Tc = N / Bc.

    The first ``Nd + 2N`` is initialising O, l, m in HBM; each column block reads Q, O, l, m and writes O, l, m.
    """
    block_c = max(1, math.ceil(sram_elements / (4 * d)))
    t_c = math.ceil(N / block_c)
    return 2 * N * d + (N * d + 2 * N) + t_c * (3 * N * d + 4 * N)


def flash2_forward_elements(N: int, d: int, block_m: int) -> float:
    """FlashAttention-2 loop order: Q read and O written once, K and V read once per Q row block.

    lse (float32, N values) is counted as 2 elements of 16 bits; the formula is in input elements for fp16/bf16.
    """
    return N * d + N * d + 2 * N + 2 * N * d * math.ceil(N / block_m)


def flash2_backward_elements(N: int, d: int, block_m: int, block_n: int) -> float:
    """Backward without atomics (triton_2kernel): Delta = rowsum(dO * O) (read 2Nd, write N fp32);
    dK/dV kernel stationary on K/V blocks of ``block_n`` re-reads Q, dO, lse, Delta per block and writes dK, dV;
    dQ kernel stationary on Q blocks of ``block_m`` re-reads K, V per block and writes dQ."""
    delta = 2 * N * d + 2 * N
    dkdv = 2 * N * d + math.ceil(N / block_n) * (2 * N * d + 4 * N) + 2 * N * d
    dq = 2 * N * d + 4 * N + math.ceil(N / block_m) * 2 * N * d + N * d
    return delta + dkdv + dq


def flash1_backward_elements(N: int, d: int, sram_elements: float) -> float:
    """FlashAttention Algorithm 4 (backward): K, V read and dK, dV written once; per column block, Q, O, dO, dQ,
    l, m are read and dQ written: ``4Nd + Tc (5Nd + 2N)`` with the forward's ``Tc = N / Bc``."""
    block_c = max(1, math.ceil(sram_elements / (4 * d)))
    t_c = math.ceil(N / block_c)
    return 4 * N * d + t_c * (5 * N * d + 2 * N)


def minimum_forward_elements(N: int, d: int) -> float:
    """Read Q, K, V once, write O once (and lse, N fp32 = 2N 16-bit elements): the floor of any algorithm."""
    return 4 * N * d + 2 * N


def minimum_backward_elements(N: int, d: int) -> float:
    """Read Q, K, V, O, dO once, write dQ, dK, dV once (and read lse): the floor of any backward."""
    return 8 * N * d + 2 * N


@dataclass(frozen=True)
class TheoryRow:
    """Modelled HBM bytes of one (pass, N, d) for B * H heads."""

    pass_: str
    N: int
    D: int
    B: int
    H: int
    elem_bytes: int
    sram_bytes: int
    block_m: int
    block_n: int
    minimum_bytes: float
    standard_bytes: float
    standard_fp32_bytes: float
    flash1_bytes: float
    flash2_bytes: float
    standard_over_flash1: float

    def as_row(self) -> dict:
        row = asdict(self)
        row["pass"] = row.pop("pass_")
        return row


THEORY_COLUMNS = [
    "pass",
    "N",
    "D",
    "B",
    "H",
    "elem_bytes",
    "sram_bytes",
    "block_m",
    "block_n",
    "minimum_bytes",
    "standard_bytes",
    "standard_fp32_bytes",
    "flash1_bytes",
    "flash2_bytes",
    "standard_over_flash1",
]


def theory_row(
    pass_: str,
    N: int,
    d: int,
    B: int = 1,
    H: int = 1,
    elem_bytes: int = 2,
    sram_bytes: int = H100_SRAM_BYTES,
    block_m: int = 128,
    block_n: int = 64,
) -> TheoryRow:
    """HBM bytes modelled for ``pass_`` ("fwd" or "bwd") of B * H heads (SRAM of ``sram_bytes``, FA2 tiles of
    ``block_m x block_n``)."""
    heads = B * H
    sram_elements = sram_bytes / elem_bytes
    if pass_ == "fwd":
        minimum, standard = minimum_forward_elements(N, d), standard_forward_elements(N, d)
        flash1, flash2 = flash1_forward_elements(N, d, sram_elements), flash2_forward_elements(N, d, block_m)
    elif pass_ == "bwd":
        minimum, standard = minimum_backward_elements(N, d), standard_backward_elements(N, d)
        flash1 = flash1_backward_elements(N, d, sram_elements)
        flash2 = flash2_backward_elements(N, d, block_m, block_n)
    else:
        raise ValueError(f"pass must be 'fwd' or 'bwd', got {pass_!r}")
    scale = heads * elem_bytes
    return TheoryRow(
        pass_,
        N,
        d,
        B,
        H,
        elem_bytes,
        sram_bytes,
        block_m,
        block_n,
        minimum * scale,
        standard * scale,
        standard * heads * FP32_BYTES,
        flash1 * scale,
        flash2 * scale,
        standard / flash1,
    )
