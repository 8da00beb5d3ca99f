"""scikit-learn's bundled 8x8 handwritten digits (1,797 images): real data, no files needed."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..errors import ConfigError
from . import Task
from .models import mlp


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits (pixels 0-16 as float64, n x 64; labels int64) from the file scikit-learn ships,
    without importing it (~1.4 s in each process); else through ``load_digits``."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or spec.origin is None:
        raise ConfigError("task 'digits' needs scikit-learn; install it with: pip install 'dtrain[digits]'.")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target.astype(np.int64)


def make_task(test_fraction: float = 0.2, hidden: int = 128) -> Task:
    if hidden < 1:
        raise ConfigError(f"task 'digits': hidden must be >= 1, got {hidden}; e.g. --task-arg hidden=128.")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"task 'digits': test_fraction must be in (0, 1), got {test_fraction}.")
    pixels, labels = load_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
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
        epochs=10,
    )
