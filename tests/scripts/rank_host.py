"""Prints, on every rank, where it runs (its host name, and its address towards the master: the
host itself where host names are shared) after an all-reduce that proves the group formed."""

import os
import socket

import torch

import dtrain
from dtrain.world.netif import source_address

ctx = dtrain.init()
total = ctx.all_reduce(torch.tensor([1.0]), op="sum").item()
os.write(1, f"RANK_HOST rank={ctx.rank} host={socket.gethostname()} addr={source_address(ctx.world.master_addr)} "
            f"master={ctx.world.master_addr} sum={total:g}\n".encode())
ctx.close()
