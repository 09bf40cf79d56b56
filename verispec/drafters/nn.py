"""Small neural building blocks for trained drafters (our own code, no forked modeling files)."""

from __future__ import annotations

import torch
from torch import nn

from verispec.model.graphs import sdpa
from verispec.model.kv_cache import KVCache

ROPE_THETA = 10000.0  # the rotary base of verispec's own drafter layers (EAGLE-3's is its target's)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., size] scaled to unit root mean square (in float32), times weight (broadcast)."""
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * scale).to(x.dtype) * weight


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b starting at zero: the block starts as the identity."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        return x + nn.functional.silu(self.linear(x))


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary position embedding. x: [batch, heads, T, head_dim]; positions: [T] int64, or
    [batch, T] where each sequence's rows sit at their own positions (a block drafter's training)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # [(batch,) T, half]
    if angles.dim() == 3:
        angles = angles[:, None]  # [batch, 1, T, half]: the same angles for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype,
                  theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary`'s angles at positions [n] as rows.cpp's layer loop takes them: cos and the
    sign-folded sin, [n, 1, head_dim] each in `dtype` (x * cos + x with its halves swapped *
    signed sin is what `rotary` computes)."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs  # [n, half]
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat([cos, cos], -1)[:, None].to(dtype),
            torch.cat([-sin, sin], -1)[:, None].to(dtype))


class DecoderLayer(nn.Module):
    """A pre-norm transformer layer (attention + SwiGLU MLP), as in Llama."""

    def __init__(self, size: int, heads: int, intermediate: int) -> None:
        super().__init__()
        if size % heads:
            raise ValueError(f"hidden size {size} is not a multiple of {heads} heads")
        self.heads, self.head_dim = heads, size // heads
        self.attn_norm = RMSNorm(size)
        self.qkv = nn.Linear(size, 3 * size, bias=False)
        self.out = nn.Linear(size, size, bias=False)
        self.mlp_norm = RMSNorm(size)
        self.gate_up = nn.Linear(size, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [batch, T, size]; positions: [T]. With a cache (batch 1) x follows the cached tokens.

        mask: [T, cached + T] bool (True = attend), for tree nodes that see only their ancestors;
        None is causal attention.
        """
        batch, length, size = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, self.head_dim)
                   .permute(2, 0, 3, 1, 4))  # each [batch, heads, T, head_dim]
        q, k = rotary(q, positions), rotary(k, positions)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        attended = attention(q, k, v, past, mask)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, size))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new positions over `past` cached ones and themselves, causal unless mask
    [T, past + T] bool (True = attend) says otherwise, or a fixed-shape pass's additive float mask
    over its whole key buffer (verispec.drafters.graphed; see graphs.sdpa). q: [batch, heads, T, head_dim];
    k, v: [batch, heads, past + T, head_dim] -> [batch, heads, T, head_dim]."""
    length = q.shape[2]
    if mask is not None:
        return sdpa(q, k, v, attn_mask=mask)
    if past == 0:
        return sdpa(q, k, v, is_causal=length > 1)
    if length == 1:
        return sdpa(q, k, v)
    # query i sees the cache and new tokens 0..i
    mask = torch.ones(length, past + length, dtype=torch.bool, device=q.device).tril(past)
    return sdpa(q, k, v, attn_mask=mask)
