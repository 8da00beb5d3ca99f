"""Slow links: compress the gradients or average the models now and then (`--comm`).

    dtrain run -n 2 examples/slow_link.py                  # PowerSGD, as written below
    dtrain run -n 2 --comm auto examples/slow_link.py      # or let dtrain measure and choose

A script may fix the method with ``dtrain.init(comm=...)``; this one lets ``dtrain run --comm``
(which sets ``$DTRAIN_COMM``) choose and falls back to PowerSGD.
"""

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def main() -> None:
    comm = os.environ.get("DTRAIN_COMM") or "powersgd:2"  # rank-2 PowerSGD unless --comm says otherwise
    ctx = dtrain.init(seed=0, comm=comm, comm_warmup=8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    y = (x[:, :32].sum(1) > x[:, 32:].sum(1)).long()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    for _ in range(2):
        for xb, yb in loader:
            ctx.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            optimizer.step()  # with localsgd, parameters are averaged here every H steps
            optimizer.zero_grad()
    accuracy = (ctx.unwrap(model)(x).argmax(1) == y).float().mean().item()
    record = getattr(ctx.strategy, "comm_record", lambda: {"comm_choice": "none (one process)"})()
    ctx.print(f"--comm {record['comm_choice']}: train accuracy {accuracy:.3f}")
    ctx.close()


if __name__ == "__main__":
    main()
