"""A Horovod Elastic training script, written for dtrain's tests in the style of Horovod's
elastic examples (only the import names dtrain):

    dtrain run -n 2 --max-restarts 1 tests/scripts/hvd_elastic.py OUT.json --kill 1:5

An ``ElasticSampler`` splits a small regression set; every step's samples (all ranks') are kept
in the state, so the result says which samples each committed step trained on. ``--kill R:S``:
rank R kills itself (SIGKILL) after its optimizer step S of the first attempt, before that
step's commit. Rank 0 writes OUT.json at the end: the steps' samples, the final weights, how
many resets the callbacks saw, and the world size.
"""

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dtrain.compat.horovod as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--kill", default=None, help="RANK:STEP")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
features = torch.randn(args.samples, 8)
dataset = TensorDataset(features, features.sum(1, keepdim=True), torch.arange(args.samples))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
kill_rank, kill_step = (int(v) for v in args.kill.split(":")) if args.kill else (-1, -1)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        for x, y, index in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            state.steps.append([state.epoch, hvd.allgather(index).tolist()])
            state.sampler.record_batch(0, args.batch_size)
            if first_attempt and hvd.rank() == kill_rank and len(state.steps) == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


resets = 0  # reset callbacks run in this process


def on_reset():
    global resets
    resets += 1
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=[])
state.register_reset_callbacks([on_reset])
train(state)
if hvd.rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"steps": state.steps, "resets": resets, "size": hvd.size(),
                   "weight": model.weight.detach().flatten().tolist(), "bias": model.bias.item()}, f)
hvd.shutdown()
