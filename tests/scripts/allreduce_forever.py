"""A `dtrain run` script that all-reduces until stopped; each rank touches $READY_DIR/ready-RANK
after its first all-reduce, so a test knows the job is training."""

import os
import pathlib
import time

import torch

import dtrain

ctx = dtrain.init()
ready = pathlib.Path(os.environ["READY_DIR"]) / f"ready-{ctx.rank}"
while True:
    ctx.all_reduce(torch.ones(1000), op="sum")
    if not ready.exists():
        ready.touch()
    time.sleep(0.01)
