"""A GPT-style decoder (as nanoGPT's ``model.py``): token and position embeddings, pre-LayerNorm
blocks of causal self-attention and an MLP, a final LayerNorm and a head tied to the token
embedding (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

The model is an ``nn.Sequential`` of ``Embedding``, ``Block`` x layers, ``Head`` so that the
pipeline strategy can cut it between blocks; its blocks are the units of FSDP wrapping and of
activation checkpointing (``gpt_blocks``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, vocab: int, context: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Fused attention (flash / memory-efficient kernels where the device has them).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)) (pre-LN, as GPT-2)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(*, vocab: int, context: int, layers: int, heads: int, width: int, dropout: float = 0.0, tie: bool = True) -> nn.Sequential:
    """``Sequential(embed, block0..blockN-1, head)``, initialised as GPT-2 (normal 0.02; the
    residual projections scaled by 1/sqrt(2 x layers))."""
    model = nn.Sequential()
    model.add_module("embed", Embedding(vocab, context, width, dropout))
    for i in range(layers):
        model.add_module(f"block{i}", Block(width, heads, dropout))
    model.add_module("head", Head(width, vocab))
    for name, p in model.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.2.weight")):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
        elif p.dim() == 2:
            nn.init.normal_(p, 0.0, 0.02)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    if tie:
        model.head.out.weight = model.embed.tok.weight  # weight tying (Press & Wolf, 2017)
    return model


def gpt_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a ``gpt`` model."""
    return [m for m in model.modules() if isinstance(m, Block)]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over every token of the batch: (B, T, V), (B, T) -> ()."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of each sample (B,): ``ctx.evaluate``'s per-sample metric,
    so its mean over a data set of equal-length windows is the validation loss per token."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(dim=1)
