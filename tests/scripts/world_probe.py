"""Prints, on every rank, the world dtrain detected, after an all-reduce that proves the group formed."""

import json
import os

import torch

import dtrain

ctx = dtrain.init()
total = ctx.all_reduce(torch.tensor([1.0]), op="sum").item()
w = ctx.world
line = "PROBE " + json.dumps({"rank": w.rank, "size": w.size, "local_rank": w.local_rank, "local_size": w.local_size,
                            "node_rank": w.node_rank, "source": w.source, "master_addr": w.master_addr,
                            "sum": total, "slurm_job_id": w.slurm_job_id}) + "\n"
# One write: the ranks of a node share the launcher's stdout, and print() may split a line into
# two writes (text, then newline) that interleave with another rank's.
os.write(1, line.encode())
ctx.close()
