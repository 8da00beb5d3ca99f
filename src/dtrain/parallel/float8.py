"""float8 training through torchao (``--precision float8``), as torchtitan's converter: the linears
inside the task's blocks (without blocks, all but the output head) with both sides multiples of 16
(``torch._scaled_mm``) and, on real float8, large enough that the matmul repays the casts of its
inputs (torchao's ``_auto_filter_for_recipe``) become torchao's ``Float8Linear``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._log import logger, note_once
from ..precision import Float8Config


def gains(linear: nn.Linear, recipe: str) -> bool:
    """torchao's size rule for ``recipe`` (see the module's docstring): whether float8 pays."""
    n, k = linear.out_features, linear.in_features
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not (k <= 4096 and n <= 1024)


def converts(model: nn.Module, config: Float8Config, blocks: Sequence[nn.Module] = ()) -> list[str]:
    """Names of the linears ``apply_float8`` converts (see the module's docstring)."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if blocks:
        inside = {id(m) for b in blocks for m in b.modules()}
        linears = [(name, m) for name, m in linears if id(m) in inside]
    elif linears:
        linears = linears[:-1]  # the output head
    return [name for name, m in linears
            if m.in_features % 16 == 0 and m.out_features % 16 == 0 and (config.emulate or gains(m, config.recipe))]


def apply_float8(model: nn.Module, config: Float8Config, blocks: Sequence[nn.Module] = (), *, sharded: bool = False) -> int:
    """Swap the linears ``converts`` names for torchao's ``Float8Linear`` in place (their parameters
    stay the same tensors, so ties hold); returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(converts(model, config, blocks))
    if not chosen:
        if not config.auto:
            note_once("float8: no linear layer of the blocks is large enough to gain from float8 with sides that are "
                      "multiples of 16; the run is bf16-mixed.")
        return 0
    if config.recipe == "tensorwise":
        ao = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded, emulate=config.emulate)
    else:
        from dataclasses import replace

        ao = replace(Float8LinearConfig.from_recipe_name(config.recipe), emulate=config.emulate)
    convert_to_float8_training(model, config=ao, module_filter_fn=lambda m, name: name in chosen)
    total = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    logger.info(f"float8: {len(chosen)} of {total} linear layers converted ({config.recipe}{', emulated' if config.emulate else ''}"
                f"{', all-gathered in float8' if sharded and config.recipe == 'tensorwise' else ''}); the rest run in bf16")
    return len(chosen)


def after_step(model: nn.Module) -> None:
    """Under FSDP with float8 all-gathers, after each optimizer step: every float8 weight's scale for
    the next all-gather, in one all-reduce. Collective: call on every rank."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
