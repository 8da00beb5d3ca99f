"""Prints, on every rank, where it runs (its host name) after an all-reduce that proves the group formed."""

import os
import socket

import torch

import dtrain

ctx = dtrain.init()
total = ctx.all_reduce(torch.tensor([1.0]), op="sum").item()
os.write(1, f"RANK_HOST rank={ctx.rank} host={socket.gethostname()} master={ctx.world.master_addr} sum={total:g}\n".encode())
ctx.close()
