"""A task whose every step is the whole training set (32 samples = 4 processes x 8): the mean
gradient of a step does not depend on how the samples are ordered or split, so the same job run
as 2 replica groups x 2 FSDP processes and as plain fsdp on 4 ranks trains the same parameters.
SGD (the task default, momentum 0.9: state a returning group heals too), linear in the gradient:
a rounding difference stays one (Adam's normalisation would magnify it on near-zero gradients)."""

import torch
from torch.utils.data import TensorDataset

from tests.user_task import PacedDataset


def make(pace_file=None, epochs="6", data_dir=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    y = (x.sum(1) > 0).long()
    train = PacedDataset(pace_file, x[:32], y[:32]) if pace_file else TensorDataset(x[:32], y[:32])
    return {
        "build_model": lambda: torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
        "train_set": train,
        "test_set": TensorDataset(x[32:], y[32:]),
        "optimizer": "sgd",
        "lr": 0.1,
        "batch_size": 8,
        "epochs": int(epochs),
    }
