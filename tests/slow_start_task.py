"""A task whose first training step is slow on purpose (a stand-in for torch.compile's first
step): its model sleeps ``first_s`` seconds in its first forward, then ``step_ms`` in every one."""

import time

import torch
from torch.utils.data import TensorDataset


class SlowStart(torch.nn.Module):
    def __init__(self, first_s: float, step_ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.first_s, self.step_ms, self.calls = first_s, step_ms, 0

    def forward(self, x):
        self.calls += 1
        if self.training:
            time.sleep(self.first_s if self.calls == 1 else self.step_ms / 1000.0)
        return self.net(x)


def make(first_s: float = 3.0, step_ms: float = 20.0, data_dir=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 4, generator=g)
    y = (x.sum(1) > 0).long()
    return {
        "build_model": lambda: SlowStart(float(first_s), float(step_ms)),
        "train_set": TensorDataset(x, y),
        "test_set": None,
        "optimizer": "sgd",
        "lr": 0.01,
        "batch_size": 16,
        "epochs": 1,
    }
