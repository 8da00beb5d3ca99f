"""Model transforms applied by ``ctx.setup`` around the strategy's wrapping, in torchtitan's
order (``parallelize_llama``: activation checkpointing, then ``torch.compile`` per block, then
FSDP/DDP):

1. ``apply_activation_checkpointing(blocks)``: each block's activations are recomputed in
   backward instead of kept from forward (Chen et al., "Training Deep Nets with Sublinear
   Memory Cost", 2016), with ``torch.utils.checkpoint``'s non-reentrant form.
2. ``apply_compile``: under fully_shard, pipeline or activation checkpointing
   (``compile_per_block``), ``torch.compile`` each block in place, before the strategy wraps the
   model (so FSDP2 shards compiled blocks); otherwise the model is compiled whole *after*
   wrapping, as torch's documentation does for DDP (the compiled DDP module splits its graph at
   bucket boundaries: DDPOptimizer), which measured faster than per block.

Both change modules in place (``Module.compile``, an instance ``forward``), so parameter names
and checkpoints stay the same as without them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError


def apply_activation_checkpointing(blocks: Sequence[nn.Module]) -> int:
    """Recompute each block's forward in backward; returns how many blocks were changed."""
    done = 0
    for block in blocks:
        if getattr(block, "_dtrain_checkpointed", False):
            continue
        block.forward = _checkpointed(block.forward)  # instance attribute: the class is untouched
        block._dtrain_checkpointed = True
        done += 1
    return done


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with inputs that need no grad, with kwargs, and under FSDP2
        # (whose pre-backward hooks gather the parameters before the recomputation).
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` each block in place (``Module.compile``; parameter names unchanged)."""
    for block in blocks:
        block.compile()


def compile_per_block(capabilities: Any, activation_checkpointing: bool) -> bool:
    """Where ``--compile`` goes when the model has blocks: each block apart under fully_shard
    (its per-block all-gather and reshard hooks stay between the compiled graphs, as torchtitan
    does), for pipeline stages, and with activation checkpointing (the recomputed unit is a
    block); otherwise the whole model after wrapping, which was faster (one graph: no break and
    no guard check between blocks; measured in benchmarks/results/28-gpu-readiness.md, and on an
    H100 in issue 28: whole 456k-517k tokens/s against per block 392k-414k)."""
    return bool(capabilities.sharded_params or capabilities.staged_step or activation_checkpointing)


def check_options(*, compile: bool, activation_checkpointing: bool, has_blocks: bool) -> None:
    """One-line errors for combinations that cannot work, before anything is built. (--compile
    composes with every strategy: single, dp, ddp, zero1, hvd, fsdp, hsdp and pipeline each
    trained a compiled lm on torch 2.13 CPU; with activation checkpointing too for single,
    ddp, fsdp, hsdp and pipeline.)"""
    if activation_checkpointing and not has_blocks:
        raise ConfigError(
            "--activation-checkpointing needs the model's blocks, and none were given; "
            "pass ctx.setup(model, optimizer, blocks=[...]) or set Task.blocks in your task."
        )
