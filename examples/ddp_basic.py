"""The smallest complete dtrain script: DDP, sharded data, exact-once evaluation.

    dtrain run -n 2 examples/ddp_basic.py
"""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def main() -> None:
    ctx = dtrain.init(strategy="ddp" if dtrain.World.detect().distributed else "single", seed=0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, test = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(DataLoader(train, batch_size=32, shuffle=True))

    for epoch in range(5):
        for xb, yb in loader:  # a new pass is a new, reshuffled epoch: no set_epoch needed
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            ctx.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        mean_loss = ctx.all_reduce(loss.detach(), op="mean").item()
        ctx.print(f"epoch {epoch}: loss {mean_loss:.4f}")

    result = ctx.evaluate(model, test, metric=lambda out, t: (out.argmax(1) == t).float())
    ctx.print(f"test accuracy {result['metric']:.4f} on {result['count']} samples (each counted once)")
    ctx.close()


if __name__ == "__main__":
    main()
