"""Per-step fault tolerance in your own loop (torchft): lose a replica group, keep stepping.

    pip install 'dtrain[ft]'
    dtrain run --fault-tolerance -n 2 --max-restarts 3 examples/fault_tolerant.py --ledger ledger
    # kill -9 one group's process: the other goes on at once; the launcher restarts the lost one, which heals
    # from the other's memory and steps with it again
    dtrain ckpt ledger ledger          # every sample trained exactly once over the committed steps

Each process is one replica group. A batch is this group's share of the next step; a step counts
only when ``ctx.should_commit()`` says so (a group lost mid-step: nobody commits it, and its samples
are trained again by the groups left). With --accumulate K a step is K batches (ctx.accumulate): one
quorum and one vote per step. SIGTERM to a group's process is a clean leave: the step in flight
finishes, the loop ends, and ctx.close() exits with status 143 (save before it), so the launcher does
not restart the group while the others go on. Started without --fault-tolerance (dtrain run -n 2
examples/fault_tolerant.py), the same script is a DDP job.
"""

import argparse
import hashlib

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import dtrain


def digits() -> tuple[TensorDataset, TensorDataset]:
    data = load_digits()
    x, y = torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def main(train=None, test=None, *, epochs: int = 5, ledger: str | None = None, accumulate: int = 1, on_commit=None) -> dict:
    # Fault tolerant where dtrain run --fault-tolerance started this process (the job's Lighthouse and this
    # group's id come from it); elsewhere (dtrain run -n 2) plain DDP, and should_commit() is always True.
    ctx = dtrain.init(seed=0)
    if train is None:
        train, test = digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model, optimizer = ctx.setup(model, torch.optim.Adam(model.parameters(), lr=3e-3))  # what a returning group heals from
    loader = ctx.setup_dataloader(DataLoader(train, batch_size=32, shuffle=True), ledger=ledger)

    loss = torch.zeros(())
    for epoch in range(loader.next_epoch, epochs):  # a group that healed from a peer starts at the peer's epoch
        for xb, yb in loader:  # each batch: the step's quorum, then this group's share of it
            optimizer.zero_grad()
            with ctx.accumulate(model, steps=accumulate):  # a step of `accumulate` batches: one quorum, one vote
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                ctx.backward(loss)
            if ctx.should_commit():  # gradients averaged over the groups; False: a group was lost mid-step
                optimizer.step()
                if on_commit is not None:
                    on_commit(loss.item())
        ctx.print(f"epoch {epoch}: loss {loss.item():.4f}")

    accuracy = ctx.evaluate(model, test, metric=lambda out, t: (out.argmax(1) == t).float())["metric"]
    weights = b"".join(p.detach().numpy().tobytes() for p in ctx.unwrap(model).parameters())
    ctx.close()
    return {"test_acc": round(accuracy, 4), "weights_sha256": hashlib.sha256(weights).hexdigest()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--ledger", default=None, help="a folder for the committed steps' samples")
    parser.add_argument("--accumulate", type=int, default=1, help="batches a step (ctx.accumulate)")
    args = parser.parse_args()
    result = main(epochs=args.epochs, ledger=args.ledger, accumulate=args.accumulate)
    print(result, flush=True)
