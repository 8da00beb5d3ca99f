"""Full-state checkpoints and exact resume from a script of your own.

    dtrain run -n 2 --max-restarts 3 examples/checkpoint_resume.py ckpt
    dtrain run -n 2 --max-restarts 3 examples/checkpoint_resume.py ckpt --crash 1:7   # rank 1 dies after step 7

``ckpt.resume`` at the start makes the script continue from the newest valid checkpoint: after
an elastic restart, after a manual restart, and on another number of processes. ``--crash
RANK:STEP`` SIGKILLs that rank after that step on the first attempt only, to try it out.
"""

import argparse
import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtrain

p = argparse.ArgumentParser()
p.add_argument("checkpoint_dir")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--save-every", type=int, default=3)
p.add_argument("--crash", default=None, metavar="RANK:STEP")
args = p.parse_args()

ctx = dtrain.init(seed=0)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))  # dropout: needs the RNG state
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
model, optimizer = ctx.setup(model, optimizer)
loader = ctx.setup_dataloader(DataLoader(data, batch_size=16, shuffle=True))

ckpt = ctx.checkpoints(args.checkpoint_dir, keep=2)
meta = ckpt.resume(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)  # None: fresh start
step = meta["step"] if meta else 0
crash_rank, crash_step = (int(v) for v in args.crash.split(":")) if args.crash else (-1, -1)

while loader.next_epoch < args.epochs:  # a resumed run continues inside the interrupted epoch
    for xb, yb in loader:
        ctx.backward(nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step += 1
        if ctx.rank == crash_rank and step == crash_step and ctx.world.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            ckpt.save(step, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
ckpt.save(step, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
ckpt.wait()
ctx.print(json.dumps({"steps": step, "resumed_from": meta and meta["step"], "restarts": ctx.world.restart_count,
                      "lr": scheduler.get_last_lr()[0]}))
ctx.close()
