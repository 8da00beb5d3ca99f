"""A `dtrain run` script whose rank 1 freezes itself with SIGSTOP at step 5 of the first attempt, as
a hung machine or a debugger would (its watchdog thread is frozen too). A restarted attempt runs
10 steps and ends.

    dtrain run -n 2 --stall-timeout 15 tests/scripts/freeze.py                  # the job ends
    dtrain run -n 2 --stall-timeout 15 --max-restarts 1 tests/scripts/freeze.py # it restarts
"""

import os
import signal
import time

import torch

import dtrain

ctx = dtrain.init("ddp", seed=0)
model = torch.nn.Linear(8, 2)
model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
restarted = ctx.world.restart_count > 0
step = 0
while not restarted or step < 10:
    ctx.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    opt.zero_grad()
    step += 1
    if restarted and step == 1:
        print(f"restarted, first step at {time.time():.3f}", flush=True)
    if not restarted and step == 5 and ctx.rank == 1:
        print(f"frozen at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.01)
ctx.print("finished")
ctx.close()
