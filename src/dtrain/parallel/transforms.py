"""Activation checkpointing and per-block ``torch.compile``, applied by the apply path before the
data-parallel wrap, in torchtitan's order. Both change modules in place (an instance ``forward``,
``Module.compile``), so parameter names and checkpoints stay the same as without them.
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


def compile_per_block(capabilities: Any, activation_checkpointing: bool) -> bool:
    """Whether ``--compile`` goes per block: under fully_shard (its hooks stay between the compiled
    graphs), for pipeline stages and with activation checkpointing; else one graph is faster."""
    return bool(capabilities.sharded_params or capabilities.staged_step or activation_checkpointing)


def check_options(*, compile: bool, activation_checkpointing: bool, has_blocks: bool) -> None:
    """One-line errors for combinations that cannot work, before anything is built."""
    if activation_checkpointing and not has_blocks:
        raise ConfigError(
            "--activation-checkpointing needs the model's blocks, and none were given; "
            "pass ctx.setup(model, optimizer, blocks=[...]) or set Task.blocks in your task."
        )
