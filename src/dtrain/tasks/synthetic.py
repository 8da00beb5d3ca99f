"""Random inputs of a configurable shape with learnable labels, for throughput measurements.

Labels come from a fixed random linear "teacher", so accuracy above chance means learning.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

from ..errors import ConfigError
from . import Task
from .models import MnistNet, mlp

MAX_BYTES = 16 * 2**30
"""Largest data set the synthetic task makes (inputs in float32): a typo must not eat the machine."""


def _shape(spec: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in spec.lower().split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise ConfigError(f"task 'synthetic': shape {spec!r} is not like 1x28x28; give positive sizes joined by 'x'.")
    return dims


def make_task(shape: str = "1x28x28", classes: int = 10, samples: int = 8192, model: str = "mlp", hidden: int = 512, layers: int = 2, seed: int = 0) -> Task:
    dims = _shape(shape)
    for name, value, least in (("classes", classes, 2), ("samples", samples, 1), ("hidden", hidden, 1), ("layers", layers, 0)):
        if value < least:
            raise ConfigError(f"task 'synthetic': {name} must be >= {least}, got {value}; e.g. --task-arg {name}={max(least, 2)}.")
    size = (samples + max(1, samples // 8)) * math.prod(dims) * 4
    if size > MAX_BYTES:
        raise ConfigError(f"task 'synthetic': samples={samples} of shape {shape} need {size / 2**30:.0f} GiB of memory "
                          f"(at most {MAX_BYTES // 2**30} GiB); lower samples or the shape.")
    if model not in ("mlp", "convnet"):
        raise ConfigError(f"task 'synthetic': model {model!r} unknown; choose mlp or convnet.")
    if model == "convnet" and dims != (1, 28, 28):
        raise ConfigError(f"task 'synthetic': model convnet needs shape 1x28x28, got {shape}.")
    if model == "convnet" and classes != 10:
        raise ConfigError(f"task 'synthetic': model convnet has 10 outputs, so classes must be 10, got {classes}; use model=mlp for {classes} classes.")
    g = torch.Generator().manual_seed(seed)
    n_test = max(1, samples // 8)
    x = torch.randn(samples + n_test, *dims, generator=g)
    teacher = torch.randn(math.prod(dims), classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    build = MnistNet if model == "convnet" else (lambda: mlp(math.prod(dims), hidden, classes, layers))
    return Task(
        name="synthetic",
        build_model=build,
        train_set=TensorDataset(x[:samples], y[:samples]),
        test_set=TensorDataset(x[samples:], y[samples:]),
        batch_size=64,
    )
