"""A small GPT-style model for the SDPA drop-in tests: pre-norm blocks of causal grouped-query self-attention (through
``torch.nn.functional.scaled_dot_product_attention``, looked up at call time so that ``attnzoo.sdpa_patched`` reaches
it) and an MLP, trained on next-token prediction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo import oracle


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(batch, seqlen, self.heads, self.head_dim).transpose(1, 2)  # [B, H, N, D] views of [B, N, H, D]
        k = k.view(batch, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seqlen, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 97, width: int = 64, heads: int = 4, kv_heads: int = 2, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(dtype: torch.dtype, device: str, steps: int = 4, seqlen: int = 48, batch: int = 3, **model_options):
    """Train a freshly seeded model for ``steps`` steps -> (losses per step as float64, first step's gradients).

    The same seed gives the same initial weights and data in every dtype (initialised in float64, then cast)."""
    torch.manual_seed(0)
    model = TinyGPT(**model_options).double().to(device=device, dtype=dtype)
    vocab = model.head.out_features
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seqlen + 1), generator=gen).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first_grads = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.double().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if first_grads is None:
            first_grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters()}
        losses.append(loss.detach().double())
        optimizer.step()
    return torch.stack(losses), first_grads


def assert_within_rule(name: str, got: torch.Tensor, baseline: torch.Tensor, exact: torch.Tensor, dtype) -> float:
    """SPEC.md's rule: at most twice plain PyTorch's error against the float64 run, plus one rounding unit of the
    dtype relative to the magnitude (with a floor of 1).  Returns error / bound."""
    magnitude = max(1.0, float(exact.abs().max()))
    baseline_error = float((baseline - exact).abs().max())
    bound = 2.0 * baseline_error + oracle.EPS[dtype] * magnitude
    error = float((got - exact).abs().max())
    assert error <= bound, f"{name}: error {error:.3e} > bound {bound:.3e} (plain PyTorch {baseline_error:.3e})"
    return error / bound
