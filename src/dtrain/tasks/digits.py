"""scikit-learn's bundled 8x8 handwritten digits (1,797 images): real data, no files needed."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ..errors import ConfigError
from . import Task
from .models import mlp


def make_task(test_fraction: float = 0.2, hidden: int = 128) -> Task:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("task 'digits' needs scikit-learn; install it with: pip install 'dtrain[digits]'.") from None
    if hidden < 1:
        raise ConfigError(f"task 'digits': hidden must be >= 1, got {hidden}; e.g. --task-arg hidden=128.")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"task 'digits': test_fraction must be in (0, 1), got {test_fraction}.")
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    # A fixed split, the same on every rank and every run.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Task(
        name="digits",
        build_model=lambda: mlp(64, hidden, 10),
        train_set=TensorDataset(x[train], y[train]),
        test_set=TensorDataset(x[test], y[test]),
        optimizer="adam",
        lr=0.003,
        batch_size=32,
        epochs=10,
    )
