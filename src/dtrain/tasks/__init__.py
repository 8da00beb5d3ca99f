"""Tasks: a model, its data sets, its loss and its metric, as one value: the built-ins (``BUILTIN``,
one module each), ``hf:PATH``, or a user's ``MODULE:FUNCTION`` returning a ``Task`` (or a dict of
its fields), which may take ``data_dir`` and any ``--task-arg KEY=VALUE`` as keyword arguments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .. import _check as check
from ..errors import ConfigError


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """1.0 per sample whose arg-max class is the target, else 0.0."""
    return (outputs.argmax(dim=1) == targets).float()


@dataclass(frozen=True, kw_only=True)
class Task:
    """Everything ``dtrain train`` and ``dtrain bench`` need to know about a workload."""

    name: str
    build_model: Callable[[], nn.Module]
    """Builds a fresh model; called once per rank after seeding, so ranks start identical."""
    train_set: Dataset
    test_set: Dataset | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = accuracy
    """Per-sample score on the test set (default: accuracy); reported as ``metric_name``."""
    metric_name: str = "test_acc"
    """The result record's name for the mean of ``metric`` (e.g. ``val_loss``)."""
    derived_metrics: Callable[[float], dict[str, float]] | None = None
    """Figures computed from the metric's value for the result record (lm: perplexity)."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (sequence models): the record then also gives ``tokens_per_s``."""
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    """The model's repeated blocks (transformer blocks, ResNet stages): the units of activation
    checkpointing, FSDP wrapping and pipeline splitting. None: the strategy's own default."""
    tp_plan: Callable[[nn.Module, int], dict[str, Any]] | None = None
    """Tensor parallelism: ``tp_plan(model, tp)`` gives ``{submodule name: ParallelStyle}`` for
    ``parallelize_module``. None: the task cannot run with ``--parallel tp=N`` (N > 1)."""
    load_weights: Callable[[nn.Module], None] | None = None
    """Called on every rank with the model ``Context.setup`` returned, so each rank reads only its
    own shards (hf:PATH's ``--init-from``). None: ``build_model`` made the starting weights."""
    optimizer: str = "sgd"
    """Default optimizer: one of ``OPTIMIZERS``."""
    lr: float = 0.01
    batch_size: int = 32
    """Default batch of one process."""
    epochs: int = 1

    def __post_init__(self) -> None:
        where = f"task {self.name!r}"
        for name in ("build_model", "loss_fn", "metric"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"{where}: {name} is a {type(getattr(self, name)).__name__}, not a function; give a callable.")
        for name in ("train_set", "test_set"):
            data = getattr(self, name)
            if (data is not None or name == "train_set") and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
                raise ConfigError(f"{where}: {name} is a {type(data).__name__}; give a map-style torch Dataset (with __len__ and __getitem__).")
        for name in ("batch_size", "epochs"):
            check.integer(f"{where}: {name}", getattr(self, name), minimum=1)
        check.number(f"{where}: lr", self.lr, positive=True)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"task {self.name!r}: unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}.")

    def new_model(self) -> nn.Module:
        """``build_model()``, checked: a task function's mistake is one line, not a traceback later."""
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"task {self.name!r}: build_model() returned {type(model).__name__}; return a torch.nn.Module.")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"task {self.name!r}: build_model() returned a model with no trainable parameters; nothing to train.")
        return model


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, **kw: torch.optim.SGD(params, lr=lr, momentum=0.9, **kw),
    "adam": lambda params, lr, **kw: torch.optim.Adam(params, lr=lr, **kw),
    "adamw": lambda params, lr, **kw: torch.optim.AdamW(params, lr=lr, **kw),
    "adadelta": lambda params, lr, **kw: torch.optim.Adadelta(params, lr=lr, **kw),
}


def check_optimizer(name: str) -> None:
    """``name`` is one of ``OPTIMIZERS``, or one line."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}.")


def make_optimizer(name: str, params, lr: float, device: torch.device | None = None) -> torch.optim.Optimizer:
    """Optimizer ``name``; on a CUDA ``device`` its fused implementation (``dtrain.world.fastpath``)."""
    check_optimizer(name)
    from ..world.fastpath import optimizer_options

    return OPTIMIZERS[name](params, lr, **optimizer_options(name, device))


BUILTIN = ("digits", "images", "lm", "mnist", "synthetic")


def load_task(spec: str, *, data_dir: str | None = None, options: dict[str, str] | None = None) -> Task:
    """Build the task named by ``spec``: a built-in name or ``MODULE:FUNCTION``."""
    options = dict(options or {})
    if spec in BUILTIN:
        module = importlib.import_module(f"{__name__}.{spec}")
        factory = module.make_task
    elif spec.startswith("hf:"):  # a transformers model's folder (dtrain.tasks.hf); before MODULE:FUNCTION
        from .hf import make_task

        factory = functools.partial(make_task, spec[3:])
    elif ":" in spec:
        factory = _import_function(spec)
    else:
        raise ConfigError(f"unknown task {spec!r}; choose one of: {', '.join(BUILTIN)}, hf:PATH (a transformers model's folder), "
                          "or MODULE:FUNCTION for your own.")
    task = _call_factory(spec, factory, data_dir, options)
    if isinstance(task, dict):
        names = {f.name for f in fields(Task)}
        unknown = set(task) - names
        if unknown:
            raise ConfigError(f"task {spec!r} returned unknown fields {sorted(unknown)}; allowed: {sorted(names)}.")
        task = Task(**{"name": spec, **task})
    if not isinstance(task, Task):
        raise ConfigError(f"task {spec!r} returned {type(task).__name__}; return a dtrain.Task or a dict of its fields.")
    return task


def _import_function(spec: str) -> Callable[..., Any]:
    module_name, _, func_name = spec.rpartition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `dtrain train --task mytask:make` finds ./mytask.py, like python -m
    if not module_name or not func_name:
        raise ConfigError(f"task {spec!r} is not MODULE:FUNCTION; write e.g. --task mytask:make_task.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task {spec!r}: cannot import module {module_name!r} ({exc}); check the name and PYTHONPATH.") from None
    except SyntaxError as exc:
        raise ConfigError(f"task {spec!r}: module {module_name!r} has a syntax error ({exc.filename}, line {exc.lineno}); fix the file.") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"task {spec!r}: module {module_name!r} has no function {func_name!r}.")
    return func


def _call_factory(spec: str, factory: Callable[..., Any], data_dir: str | None, options: dict[str, str]) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        raise ConfigError(f"task {spec!r} is not a Python function dtrain can inspect; point it at a function returning a dtrain.Task.") from None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if "data_dir" in params or takes_any:
        kwargs["data_dir"] = data_dir
    for key, value in options.items():
        if key not in params and not takes_any:
            accepted = [p for p in params if p != "data_dir"]
            raise ConfigError(f"task {spec!r} takes no option {key!r}; it accepts: {', '.join(accepted) or 'none'}.")
        kwargs[key] = _coerce(value, params.get(key))
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"task {spec!r} cannot be called with {sorted(kwargs) or 'no arguments'} ({exc}); "
                          "give it defaults, or pass its options with --task-arg KEY=VALUE.") from None
    return factory(**kwargs)


def _coerce(value: str, param: inspect.Parameter | None) -> Any:
    """Convert a --task-arg string to the type of the parameter's default."""
    default = param.default if param is not None else inspect.Parameter.empty
    if default is inspect.Parameter.empty or default is None or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes", "on")
        return type(default)(value)
    except ValueError:
        kind = {"int": "an integer", "float": "a number"}.get(type(default).__name__, f"a {type(default).__name__}")
        raise ConfigError(f"task option {param.name}={value!r} is not {kind}; e.g. --task-arg {param.name}={default}.") from None


__all__ = ["BUILTIN", "OPTIMIZERS", "Task", "accuracy", "load_task", "make_optimizer"]
