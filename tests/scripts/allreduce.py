"""A 2-process script for `dtrain run`: every rank adds its rank+1; rank 0 prints the sum."""

import sys

import torch

import dtrain

ctx = dtrain.init()
t = ctx.all_reduce(torch.tensor([float(ctx.rank + 1)]), op="sum")
ctx.print(f"world={ctx.world_size} sum={t.item():g} argv={sys.argv[1:]}")
ctx.close()
