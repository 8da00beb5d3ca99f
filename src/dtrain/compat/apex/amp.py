"""apex.amp on torch.autocast and torch.amp.GradScaler.

``opt_level``: ``O0`` is fp32; ``O1`` runs the forward pass under autocast (fp16 on GPU, bf16
on CPU) with dynamic loss scaling on GPU; ``O2`` (apex: fp16 model, fp32 master weights) is the
same here, because under autocast the parameters stay fp32 and are already the master weights.
``O3`` (pure fp16) is not supported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import dtrain
from dtrain import ConfigError
from dtrain._log import note_once
from dtrain.precision import scaler_skips_itself

OPT_LEVELS = ("O0", "O1", "O2")


class _State:
    """What ``initialize`` set up, for ``scale_loss``, the patched steps and the state dicts."""

    precision: dtrain.Precision | None = None
    scaler: torch.amp.GradScaler | None = None


_state = _State()


def initialize(
    models: nn.Module | list[nn.Module],
    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Prepare ``models`` and ``optimizers`` for ``opt_level``; returns them as they were passed
    (one or a list each). Call after moving the model to its device, before wrapping it in DDP."""
    if opt_level not in OPT_LEVELS:
        hint = " O3 (pure fp16) is not supported; use O2." if opt_level == "O3" else ""
        raise ConfigError(f"unknown opt_level {opt_level!r}; choose one of: {', '.join(OPT_LEVELS)}.{hint}")
    model_list = models if isinstance(models, (list, tuple)) else [models]
    opt_list = [] if optimizers is None else optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    bad = [m for m in model_list if not isinstance(m, nn.Module)] or not model_list and [models]
    if bad:
        raise ConfigError(f"amp.initialize got {type(bad[0]).__name__} {bad[0]!r:.40} for a model; give a torch.nn.Module (or a list of them).")
    bad = [o for o in opt_list if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise ConfigError(f"amp.initialize got {type(bad[0]).__name__} {bad[0]!r:.40} for an optimizer; give a torch.optim.Optimizer (or a list of them).")
    device = _device_of(model_list[0])
    preset = "fp32" if not enabled or opt_level == "O0" else "fp16-mixed"
    if opt_level == "O2" and enabled:
        note_once("apex O2 runs as autocast with fp32 parameters (torch's master weights); no fp16 copy of the model is made.")
    precision = dtrain.Precision.resolve(preset, device)
    _state.precision = precision
    _state.scaler = _make_scaler(precision, loss_scale, device)
    if precision.autocast_dtype is not None:
        for m in model_list:
            m.forward = functools.partial(_autocast_forward, m.forward, precision)  # type: ignore[method-assign]
    for opt in opt_list:
        _patch_step(opt)
    if optimizers is None:
        return models
    return models, optimizers


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _make_scaler(precision: dtrain.Precision, loss_scale: float | str | None, device: torch.device) -> torch.amp.GradScaler | None:
    if not precision.scale_loss:
        if loss_scale not in (None, "dynamic", 1, 1.0):
            note_once(f"apex loss_scale={loss_scale!r} ignored: {precision.effective} on {device.type} needs no loss scaling.")
        return None
    if loss_scale in (None, "dynamic"):
        return torch.amp.GradScaler(device.type)
    try:
        scale = float(loss_scale)
    except (TypeError, ValueError):
        raise ConfigError(f"loss_scale must be a number or 'dynamic', got {loss_scale!r}.") from None
    # A static scale: start there and never grow (GradScaler still backs off on overflow).
    return torch.amp.GradScaler(device.type, init_scale=scale, growth_interval=2**31 - 1)


def _autocast_forward(forward: Any, precision: dtrain.Precision, *args: Any, **kwargs: Any) -> Any:
    with precision.autocast():
        out = forward(*args, **kwargs)
    # apex O1 computes losses in fp32; give the loss function fp32 outputs.
    return _to_float(out)


def _to_float(out: Any) -> Any:
    if torch.is_tensor(out):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_float(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_float(v) for k, v in out.items()}
    return out


def _patch_step(optimizer: torch.optim.Optimizer) -> None:
    """With a GradScaler, ``optimizer.step()`` unscales, skips steps with inf/nan gradients and
    updates the scale, as apex's patched step did."""
    if _state.scaler is None or getattr(optimizer, "_dtrain_amp", False):
        return
    scaler_skips_itself(optimizer)
    original = optimizer.step
    inside = {"now": False}

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        scaler = _state.scaler
        if inside["now"] or scaler is None:
            return original(*args, **kwargs)
        inside["now"] = True
        try:
            out = scaler.step(optimizer, *args, **kwargs)
            scaler.update()
            return out
        finally:
            inside["now"] = False

    optimizer.step = step  # type: ignore[method-assign]
    optimizer._dtrain_amp = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``."""
    if _state.precision is None:
        raise ConfigError("amp.scale_loss called before amp.initialize; call amp.initialize(model, optimizer, opt_level=...) first.")
    yield _state.scaler.scale(loss) if _state.scaler is not None else loss


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    """The fp32 parameters the optimizer updates (e.g. to clip their gradients)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scaler's state, in apex's layout (``loss_scaler0``)."""
    out = destination if destination is not None else {}
    scaler = _state.scaler
    if scaler is not None and scaler.is_enabled():
        out["loss_scaler0"] = {"loss_scale": scaler.get_scale(), "unskipped": int(scaler.state_dict().get("_growth_tracker", 0))}
    else:
        out["loss_scaler0"] = {"loss_scale": 1.0, "unskipped": 0}
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    scaler = _state.scaler
    entry = state.get("loss_scaler0")
    if entry is None:
        raise ConfigError(f"amp state has no 'loss_scaler0' entry (keys: {sorted(state)}); pass what amp.state_dict() returned.")
    if scaler is not None:
        saved = scaler.state_dict()
        saved.update(scale=float(entry["loss_scale"]), _growth_tracker=int(entry.get("unskipped", 0)))
        scaler.load_state_dict(saved)


__all__ = ["initialize", "load_state_dict", "master_params", "scale_loss", "state_dict"]
