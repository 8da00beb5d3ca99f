"""The loop benchmarks/ft_overhead.py times (``--face script``): examples/fault_tolerant.py's loop
(dtrain.init, ctx.setup, ctx.setup_dataloader, ctx.backward, ctx.should_commit), the same code as a
DDP job (`dtrain run -n 2`) and as 2 replica groups (`dtrain run --fault-tolerance -n 2`). Each
process writes the perf_counter() at the end of each step to ``--out``.PID (one number a line).

    dtrain run -n 2 benchmarks/ft_overhead_loop.py --task mnist --data-dir ../shared/data/mnist --steps 60 --out /tmp/t
"""

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def data_and_model(task: str, data_dir: str | None) -> tuple[TensorDataset, torch.nn.Module]:
    if task == "mnist":
        from dtrain.tasks.mnist import load_split
        from dtrain.tasks.models import MnistNet

        return load_split(data_dir, "train"), MnistNet()
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    return TensorDataset(x, y), torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="digits", choices=("digits", "mnist"))
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ctx = dtrain.init(seed=0)
    train, model = data_and_model(a.task, a.data_dir)
    model, optimizer = ctx.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    loader = ctx.setup_dataloader(DataLoader(train, batch_size=a.batch_size, shuffle=True))
    stamps: list[float] = []
    while len(stamps) < a.steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            ctx.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            if ctx.should_commit():
                optimizer.step()
                stamps.append(time.perf_counter())
            if len(stamps) >= a.steps:
                break
    ctx.close()
    with open(f"{a.out}.{os.getpid()}", "w") as f:
        f.write("\n".join(f"{t:.6f}" for t in stamps) + "\n")


if __name__ == "__main__":
    main()
