"""A training loop in which one rank misbehaves at step 3, for the watchdog and checker tests.

    dtrain run -n 2 tests/scripts/stall.py sleep 1      # rank 1 sleeps inside a step
    dtrain run -n 2 --debug tests/scripts/stall.py skip 1   # rank 1 skips one all-reduce
    dtrain run -n 2 --max-restarts 1 tests/scripts/stall.py sleep-once 1   # sleeps in the first attempt only
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain

mode, bad_rank = sys.argv[1], int(sys.argv[2])
ctx = dtrain.init("ddp", seed=0)
model = torch.nn.Linear(8, 2)
model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
loader = ctx.setup_dataloader(DataLoader(data, batch_size=8, shuffle=True))
for step, (x, y) in enumerate(loader):
    ctx.backward(torch.nn.functional.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()
    if step == 3 and ctx.rank == bad_rank:
        if mode == "sleep" or (mode == "sleep-once" and ctx.world.restart_count == 0):
            print(f"sleeping since {time.time():.3f}", flush=True)
            time.sleep(3600)  # THE STALL LINE
        elif mode == "skip":
            continue  # skips the all-reduce below, once
    loss = ctx.all_reduce(torch.tensor([float(step)]), op="mean")  # THE ALL-REDUCE LINE
ctx.print("finished")
ctx.close()
