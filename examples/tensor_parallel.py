"""Tensor parallelism with your own plan: each rank holds half of every layer's weights.

    dtrain run -n 2 --parallel tp=2 examples/tensor_parallel.py
    dtrain run -n 4 --parallel dp_shard=2,tp=2 examples/tensor_parallel.py    # FSDP x TP
    python examples/tensor_parallel.py                                        # one process, no plan used
"""

import torch
from sklearn.datasets import load_digits
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def plan(model: torch.nn.Module, tp: int) -> dict:
    # The first layer split by output units (no communication), the second by input units
    # (its partial sums all-reduced): one all-reduce per forward, as Megatron-LM's MLP.
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def main() -> None:
    ctx = dtrain.init(seed=0, tp_plan=plan)  # the layout comes from --parallel ($DTRAIN_PARALLEL)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train = TensorDataset(x[:1400], y[:1400])

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(DataLoader(train, batch_size=32, shuffle=True))
    for epoch in range(3):
        for xb, yb in loader:  # ranks of one TP group get the same batch
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            ctx.backward(loss)
            ctx.clip_grad_norm_(model, 1.0)  # the global norm over every rank's pieces
            optimizer.step()
            optimizer.zero_grad()
        ctx.print(f"epoch {epoch}: loss {ctx.all_reduce(loss.detach()).item():.3f} "
                  f"({ctx.strategy.name}, {ctx.data_parallel_size} data-parallel replica(s))")
    ctx.print(ctx.memory_report(model, optimizer).line())
    ctx.close()


if __name__ == "__main__":
    main()
