"""An NVIDIA apex script, unchanged except its import lines, on dtrain.

Written the way apex's ``examples/simple/distributed`` and ImageNet ``main_amp.py`` are
(--local_rank, init_process_group from env://, amp.initialize, apex DDP, amp.scale_loss,
amp.state_dict in the checkpoint), on scikit-learn's digits so it needs no downloads. The only
concession to CPU: the device and backend follow torch.cuda.is_available().

    python -m torch.distributed.launch --nproc_per_node=2 apex_style.py   # before
    dtrain run -n 2 examples/apex_style.py                                # after
"""

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from dtrain.compat.apex import amp  # was: from apex import amp
from dtrain.compat.apex.parallel import DistributedDataParallel, convert_syncbn_model  # was: from apex.parallel import ...

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--epochs", default=8, type=int)
parser.add_argument("--checkpoint", default=None)
args = parser.parse_args()

args.distributed = False
if "WORLD_SIZE" in os.environ:
    args.distributed = int(os.environ["WORLD_SIZE"]) > 1
cuda = torch.cuda.is_available()
device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
if args.distributed:
    if cuda:
        torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
world_size = torch.distributed.get_world_size() if args.distributed else 1
rank = torch.distributed.get_rank() if args.distributed else 0

torch.manual_seed(0)
digits = load_digits()
x = (torch.tensor(digits.data, dtype=torch.float32) / 16.0).to(device)
y = torch.tensor(digits.target, dtype=torch.long).to(device)
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
)
model = convert_syncbn_model(model)
model = model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
if args.distributed:
    model = DistributedDataParallel(model)

batch = 32
for epoch in range(args.epochs):
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
    for start in range(0, len(perm) - batch * world_size + 1, batch * world_size):
        idx = perm[start + rank * batch : start + (rank + 1) * batch].to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

model.eval()
with torch.no_grad():
    correct = (model(x_test).argmax(1) == y_test).float().sum()
if args.distributed:
    torch.distributed.all_reduce(correct)
    correct /= world_size  # every rank scored the whole test set
if rank == 0:
    print(f"opt_level {args.opt_level}: test accuracy {correct.item() / len(x_test):.4f}")
    if args.checkpoint:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, args.checkpoint)
if args.distributed:
    torch.distributed.destroy_process_group()
