"""A small conv net in two blocks with BatchNorm (running statistics to heal and average), for
``--channels-last``, ``--activation-checkpointing`` and ``--compile`` under ``--fault-tolerance``."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for c in (3, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def make(data_dir=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 3, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long()
    return {
        "build_model": ConvNet,
        "blocks": lambda model: list(model.blocks),
        "train_set": TensorDataset(x[:64], y[:64]),
        "test_set": TensorDataset(x[64:], y[64:]),
        "optimizer": "sgd",
        "lr": 0.1,
        "batch_size": 8,
        "epochs": 1,
    }
