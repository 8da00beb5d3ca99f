"""A user's own task, as `--task tests.user_task:make` would load it."""

import torch
from torch.utils.data import TensorDataset


def make(hidden: int = 16, data_dir=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = (x.sum(1) > 0).long()
    return {
        "build_model": lambda: torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)),
        "train_set": TensorDataset(x[:200], y[:200]),
        "test_set": TensorDataset(x[200:], y[200:]),
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 16,
        "epochs": 3,
    }


def make_dropout(data_dir=None):
    """A task whose model uses dropout, so a resume is exact only if RNG states are restored."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(320, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return {
        "build_model": lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        ),
        "train_set": TensorDataset(x[:256], y[:256]),
        "test_set": TensorDataset(x[256:], y[256:]),
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 16,
        "epochs": 2,
    }
