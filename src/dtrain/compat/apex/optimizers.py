"""``apex.optimizers`` with apex's argument names and defaults, on torch's optimizers.

FusedAdam, FusedSGD and FusedAdagrad are torch's Adam/AdamW, SGD and Adagrad (torch picks its
fused or foreach kernels itself). torch has no LAMB or NovoGrad: both are written here, on one
layer-wise step (``_layerwise_step``) that differs only in how the second moment is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import required as _required  # torch's "lr is required" marker

from dtrain import ConfigError


def _refuse(name: str, what: str, fix: str) -> None:
    raise ConfigError(f"apex.optimizers.{name}: {what} is not supported by dtrain.compat.apex; {fix}.")


class _SetGradNone:
    """apex's ``set_grad_none`` (set by each ``__init__``): what ``zero_grad()`` does when not told."""

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)  # type: ignore[misc]


class FusedAdam(_SetGradNone, torch.optim.Adam):
    """apex's FusedAdam: AdamW by default (``adam_w_mode=True``), Adam with L2 otherwise."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False, master_weights: bool = False) -> None:
        if not bias_correction:
            _refuse("FusedAdam", "bias_correction=False", "use bias_correction=True (torch's Adam always corrects)")
        if master_weights:
            _refuse("FusedAdam", "master_weights=True", "keep fp32 parameters and use torch.autocast")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         capturable=capturable, decoupled_weight_decay=adam_w_mode)
        self.set_grad_none = set_grad_none


class FusedSGD(_SetGradNone, torch.optim.SGD):
    """apex's FusedSGD (torch's SGD; ``wd_after_momentum`` is refused)."""

    def __init__(self, params: Any, lr: float = _required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if wd_after_momentum:
            _refuse("FusedSGD", "wd_after_momentum=True", "leave it False (weight decay before momentum, as torch)")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)
        self.set_grad_none = set_grad_none


class FusedAdagrad(_SetGradNone, torch.optim.Adagrad):
    """apex's FusedAdagrad (torch's Adagrad)."""

    def __init__(self, params: Any, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:
        if adagrad_w_mode:
            _refuse("FusedAdagrad", "adagrad_w_mode=True", "use weight_decay as L2 (adagrad_w_mode=False)")
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none


def _trust_ratio(p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """||w|| / ||update|| per layer (1 where either is zero): LAMB's and NovoGrad's layer-wise scale."""
    w, u = p.norm(), update.norm()
    return torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))


class _Layerwise(_SetGradNone, torch.optim.Optimizer):
    """One step for LAMB (You et al., arXiv 1904.00962) and NovoGrad (Ginsburg et al., arXiv
    1905.11286): ``per_layer_second_moment`` says how v is kept (per element, or one value per
    layer), ``trust_ratio`` whether each layer's step is scaled by ||w|| / ||update||."""

    per_layer_second_moment = False
    trust_ratio = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip = self._global_clip()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float() * clip
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = (torch.zeros((), device=p.device) if self.per_layer_second_moment
                                           else torch.zeros_like(p, dtype=torch.float32))
                state["step"] += 1
                update = self._update(p, g, state, group, beta1, beta2)
                ratio = 1.0
                if self.trust_ratio and (group.get("use_nvlamb") or group["weight_decay"]):
                    ratio = _trust_ratio(p.float(), update)
                p.add_((update * ratio).to(p.dtype), alpha=-group["lr"])
        return loss

    def _global_clip(self) -> float | torch.Tensor:
        max_norm = self.defaults.get("max_grad_norm")
        if not max_norm:
            return 1.0
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return 1.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class FusedLAMB(_Layerwise):
    """apex's FusedLAMB: Adam moments, then each layer's step scaled by ||w|| / ||update||."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False) -> None:
        if amsgrad:
            _refuse("FusedLAMB", "amsgrad=True", "leave it False (apex refuses it too)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb)
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def _update(self, p, g, state, group, beta1, beta2) -> torch.Tensor:
        if not group["adam_w_mode"] and group["weight_decay"]:
            g = g + group["weight_decay"] * p.float()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = state["step"]
        c1, c2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
        update = (m / c1) / ((v / c2).sqrt() + group["eps"])
        if group["adam_w_mode"] and group["weight_decay"]:
            update = update + group["weight_decay"] * p.float()
        return update


class FusedNovoGrad(_Layerwise):
    """apex's FusedNovoGrad: one second moment per layer (the squared gradient norm), the
    normalized gradient plus weight decay into the first moment."""

    per_layer_second_moment = True
    trust_ratio = False

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, reg_inside_moment: bool = False,
                 grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad or norm_type != 2:
            _refuse("FusedNovoGrad", "amsgrad=True or norm_type other than 2", "use the defaults")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        reg_inside_moment=reg_inside_moment, grad_averaging=grad_averaging, init_zero=init_zero,
                        max_grad_norm=0.0)
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def _update(self, p, g, state, group, beta1, beta2) -> torch.Tensor:
        v, m = state["exp_avg_sq"], state["exp_avg"]
        sq = g.pow(2).sum()
        if state["step"] == 1 and not group["init_zero"]:
            v.copy_(sq)  # NovoGrad starts v at the first gradient's norm (init_zero=False)
        else:
            v.mul_(beta2).add_(sq, alpha=1 - beta2)
        t = state["step"]
        c1, c2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
        normed = g / ((v / c2).sqrt() + group["eps"])
        if group["reg_inside_moment"] and group["weight_decay"]:
            normed = normed + group["weight_decay"] * p.float()
        m.mul_(beta1).add_(normed, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
        update = m / c1
        if not group["reg_inside_moment"] and group["weight_decay"]:
            update = update + group["weight_decay"] * p.float()
        return update


__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]
