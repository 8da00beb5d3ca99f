"""Models of the built-in tasks."""

from __future__ import annotations

import torch
from torch import nn


class MnistNet(nn.Module):
    """The ConvNet of PyTorch's MNIST example: conv 32, conv 64, dropout, fc 9216-128-10 (1.2 M params)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = self.dropout2(x)
        return self.fc2(x)


def mlp(in_features: int, hidden: int, classes: int, layers: int = 2) -> nn.Sequential:
    """Flatten, then ``layers`` hidden Linear+ReLU blocks of width ``hidden``, then the classifier."""
    blocks: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    blocks.append(nn.Linear(width, classes))
    return nn.Sequential(*blocks)
