"""Gradient accumulation: 4 micro-batches per optimizer step, one all-reduce per step.

    dtrain run -n 2 examples/grad_accumulation.py
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def main() -> None:
    ctx = dtrain.init(seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 20, generator=g)
    y = (x[:, :10].sum(1) > x[:, 10:].sum(1)).long()
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    for xb, yb in loader:
        with ctx.accumulate(model, steps=4):  # gradients sync on every 4th micro-batch only
            ctx.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            optimizer.step()  # skipped until the window's last micro-batch
            optimizer.zero_grad()
    ctx.print(f"final loss {torch.nn.functional.cross_entropy(model(x), y).item():.4f}")
    ctx.close()


if __name__ == "__main__":
    main()
