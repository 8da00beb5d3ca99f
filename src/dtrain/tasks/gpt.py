"""A GPT-2-style decoder (as nanoGPT's ``model.py``) as an ``nn.Sequential``, so that a pipeline
can cut it between blocks.
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
    """Multi-head causal self-attention. Query, key and value are separate projections so that
    tensor parallelism can split each by heads (column-wise: a rank holds whole heads); the head
    count used in ``forward`` follows from the local width, so a split module runs unchanged."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        size = c // self.heads  # per head; under tensor parallelism q holds heads/tp of them
        q, k, v = (z.view(b, t, z.shape[-1] // size, size).transpose(1, 2) for z in (q, k, v))
        # Fused attention (flash / memory-efficient kernels where the device has them).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, q.shape[1] * size)))


def _split_fused_qkv(state: dict, prefix: str, *args: object) -> None:
    """Checkpoints written before q, k and v were separate hold one ``qkv`` projection whose
    rows are [q; k; v]: split it, so they load unchanged."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3, dim=0)):
                state[f"{prefix}{name}.{kind}"] = part


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)) (pre-LN, as GPT-2)."""

    def __init__(self, width: int, heads: int, dropout: float, ffn: int | None = None) -> None:
        super().__init__()
        hidden = ffn or 4 * width
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width), nn.Dropout(dropout))

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


def gpt(*, vocab: int, context: int, layers: int, heads: int, width: int, dropout: float = 0.0, tie: bool = True,
        ffn: int | None = None) -> nn.Sequential:
    """``Sequential(embed, block0..blockN-1, head)``, initialised as GPT-2 (normal 0.02; the
    residual projections scaled by 1/sqrt(2 x layers)); ``ffn``: the MLP's hidden width (default 4 x width)."""
    model = nn.Sequential()
    model.add_module("embed", Embedding(vocab, context, width, dropout))
    for i in range(layers):
        model.add_module(f"block{i}", Block(width, heads, dropout, ffn))
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


def gpt_tp_plan(model: nn.Module, tp: int) -> dict[str, object]:
    """Megatron-LM's split of each block with sequence parallelism between them, as torchtitan's
    Llama plan; the token embedding is vocabulary-parallel and the head column-wise over the same
    rows, so a tied head stays tied."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from ..errors import ConfigError

    plan: dict[str, object] = {}
    for name, module in model.named_modules():
        if isinstance(module, Embedding):
            plan[f"{name}.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            plan[f"{name}.pos"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        elif isinstance(module, Head):
            plan[f"{name}.ln"] = SequenceParallel()
            plan[f"{name}.out"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        elif isinstance(module, Block):
            if module.attn.heads % tp:
                raise ConfigError(f"task 'lm': heads={module.attn.heads} cannot be split over tp={tp} ranks; "
                                  f"use a head count divisible by {tp} (e.g. --task-arg heads={tp * max(1, module.attn.heads // tp)}).")
            for norm, branch in (("ln1", "attn"), ("ln2", "mlp")):
                plan[f"{name}.{norm}"] = SequenceParallel()
                plan[f"{name}.{branch}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for sub in ("attn.q", "attn.k", "attn.v", "mlp.0"):
                plan[f"{name}.{sub}"] = ColwiseParallel()
            for sub in ("attn.proj", "mlp.2"):
                plan[f"{name}.{sub}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over every token of the batch: (B, T, V), (B, T) -> ()."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of each sample (B,): ``ctx.evaluate``'s per-sample metric,
    so its mean over a data set of equal-length windows is the validation loss per token."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(dim=1)
