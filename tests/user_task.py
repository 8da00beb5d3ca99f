"""A user's own task, as `--task tests.user_task:make` would load it."""

import os

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


class LoggedDataset(TensorDataset):
    """Appends every index it serves to ``log_dir/<pid>.txt``: which samples training used."""

    def __init__(self, log_dir, *tensors):
        super().__init__(*tensors)
        self.log_dir = log_dir

    def __getitem__(self, index):
        with open(os.path.join(self.log_dir, f"{os.getpid()}.txt"), "a") as fh:
            fh.write(f"{int(index)}\n")
        return super().__getitem__(index)


def make_logged(log_dir, data_dir=None):
    """``make_dropout``, with a training set that logs the samples it serves (to check exactly-once)."""
    task = make_dropout()
    return {**task, "train_set": LoggedDataset(log_dir, *task["train_set"].tensors)}


class SlowDataset(TensorDataset):
    """A TensorDataset that takes ``delay`` seconds per sample: training that lasts long enough to
    lose and add nodes while it runs."""

    def __init__(self, delay, *tensors):
        super().__init__(*tensors)
        self.delay = delay

    def __getitem__(self, index):
        import time

        time.sleep(self.delay)
        return super().__getitem__(index)


def make_slow(delay="0.002", epochs="6", data_dir=None):
    """``make_dropout`` at ``delay`` seconds per sample (16 per batch), for elastic tests."""
    task = make_dropout()
    return {**task, "train_set": SlowDataset(float(delay), *task["train_set"].tensors), "epochs": int(epochs)}
