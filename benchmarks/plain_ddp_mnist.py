"""Reference: the same MNIST workload as `dtrain train --task mnist`, written as a plain
PyTorch DDP script (torchrun, DistributedSampler, no dtrain in the training path).

Same model (PyTorch's MNIST ConvNet), per-process batch, optimizer (Adadelta, lr 1.0), data
order (DistributedSampler with seed 0 draws the same permutation as dtrain's ShardSampler)
and the same timing window (the training loop, excluding data loading and evaluation).

    torchrun --nproc-per-node 2 benchmarks/plain_ddp_mnist.py --data-dir ../shared/data/mnist
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dtrain.tasks.mnist import load_split  # data loading only (not timed)
from dtrain.tasks.models import MnistNet

p = argparse.ArgumentParser()
p.add_argument("--data-dir", required=True)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--max-steps", type=int, default=None)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--gradient-as-bucket-view", action="store_true", help="dtrain's DDP default (torch's is off)")
p.add_argument("--bucket-cap-mb", type=float, default=None,
               help="given explicitly (as dtrain does), it also caps DDP's first bucket, which is 1 MB otherwise")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
train_set = load_split(args.data_dir, "train")
torch.manual_seed(args.seed)
model = DDP(MnistNet(), gradient_as_bucket_view=args.gradient_as_bucket_view, bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
total = len(loader) if args.max_steps is None else min(args.max_steps, len(loader))

model.train()
step = 0
t0 = time.perf_counter()
for x, y in loader:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    if step >= total:
        break
elapsed = time.perf_counter() - t0
if rank == 0:
    print(json.dumps({"steps": step, "samples_per_s": round(step * args.batch_size * world / elapsed, 2), "train_loss": loss.item()}))
dist.destroy_process_group()
