"""``apex.fp16_utils``: ``to_python_float``, ``network_to_half``, ``BN_convert_float`` and
``FP16_Optimizer``'s common surface (fp32 master weights, static or dynamic loss scaling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain import ConfigError


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a number) as a Python float."""
    return float(t.item()) if hasattr(t, "item") else float(t[0]) if isinstance(t, (list, tuple)) else float(t)


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - apex's name
    """Keep batch norm layers in fp32 (their statistics need the range) after ``.half()``."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in fp16 (batch norm kept in fp32), its input cast to fp16."""
    return nn.Sequential(_ToHalf(), BN_convert_float(network.half()))


class _ToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


class FP16_Optimizer:  # noqa: N801 - apex's name
    """Wraps an optimizer over fp16 parameters: it steps fp32 master copies and copies them back.
    ``step()`` skips a step on overflow (dynamic scaling halves the scale then, and doubles it
    after ``scale_window`` clean steps)."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None, verbose: bool = False) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise ConfigError(f"FP16_Optimizer got {type(init_optimizer).__name__}; give a torch.optim.Optimizer.")
        self.optimizer = init_optimizer
        self.model_params: list[list[nn.Parameter]] = []
        for group in init_optimizer.param_groups:
            fp16 = list(group["params"])
            master = [nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad) for p in fp16]
            self.model_params.append(fp16)
            group["params"] = master
        self.dynamic = dynamic_loss_scale
        args = dynamic_loss_args or {}
        self.cur_scale = float(args.get("init_scale", 2.0 ** 16)) if dynamic_loss_scale else float(static_loss_scale)
        self.scale_window = int(args.get("scale_window", 1000))
        self._clean_steps = 0
        self.overflow = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - apex's name
        for group in self.model_params:
            for p in group:
                p.grad = None if set_grads_to_None else (p.grad.zero_() if p.grad is not None else None)
        self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        (loss.float() * self.cur_scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copy the fp16 gradients into the fp32 masters, unscaled; note an overflow."""
        self.overflow = False
        for fp16, group in zip(self.model_params, self.optimizer.param_groups):
            for p, m in zip(fp16, group["params"]):
                if p.grad is None:
                    m.grad = None
                    continue
                g = p.grad.float() / self.cur_scale
                self.overflow |= not bool(torch.isfinite(g).all())
                m.grad = g

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        params = [m for g in self.optimizer.param_groups for m in g["params"] if m.grad is not None]
        return -1.0 if self.overflow else float(nn.utils.clip_grad_norm_(params, max_norm, norm_type))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.overflow:
            if self.dynamic:
                self.cur_scale = max(self.cur_scale / 2, 1.0)
                self._clean_steps = 0
            return None
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        with torch.no_grad():
            for fp16, group in zip(self.model_params, self.optimizer.param_groups):
                for p, m in zip(fp16, group["params"]):
                    p.copy_(m)
        if self.dynamic:
            self._clean_steps += 1
            if self._clean_steps % self.scale_window == 0:
                self.cur_scale *= 2
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "dynamic": self.dynamic, "clean_steps": self._clean_steps,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": [[m.detach().clone() for m in g["params"]] for g in self.optimizer.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale, self.dynamic, self._clean_steps = state["cur_scale"], state["dynamic"], state["clean_steps"]
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        with torch.no_grad():
            for group, saved in zip(self.optimizer.param_groups, state["fp32_from_fp16"]):
                for m, s in zip(group["params"], saved):
                    m.copy_(s)


__all__ = ["BN_convert_float", "FP16_Optimizer", "network_to_half", "to_python_float"]
