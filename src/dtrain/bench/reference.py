"""The plain PyTorch DDP reference of ``dtrain bench``, started by torchrun: only the task and the
shared timing bookkeeping come from dtrain, none of the training path.
"""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dtrain.bench.measure import Recorder, grad_payload_bytes, task_options, worker_parser
from dtrain.data import default_num_workers, loader_options
from dtrain.tasks import load_task, make_optimizer
from dtrain.world import destroy_process_group


def main(argv: list[str] | None = None) -> None:
    args = worker_parser().parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    task = load_task(args.task, data_dir=args.data_dir, options=task_options(args.task_arg))
    batch = args.batch_size or task.batch_size
    net = task.build_model().to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    optimizer = make_optimizer(task.optimizer, model.parameters(), args.lr or task.lr)
    sampler = DistributedSampler(task.train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    workers = args.num_workers if args.num_workers is not None else default_num_workers(task.train_set, local)
    loader = DataLoader(task.train_set, batch_size=batch, sampler=sampler, drop_last=True, **loader_options(workers, device))
    rec = Recorder(rank=rank, world_size=world, method=args.method, batch_size=batch, device=str(device),
                   metric_name=task.metric_name, tokens_per_sample=task.tokens_per_sample,
                   train_samples=len(task.train_set))
    epoch = 0

    def batches():
        nonlocal epoch
        while True:
            sampler.set_epoch(epoch)
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            epoch += 1

    it = batches()
    model.train()

    def step(measured: bool) -> None:
        t0 = rec.clock()
        x, y = next(it)
        t_data = rec.clock()
        loss = task.loss_fn(model(x), y)
        loss.backward()
        t_fb = rec.clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rec.add_step(t0, t_data, t_fb, t_fb, rec.clock(), loss.item(), measured)

    rec.time_repeats(step, args, dist.barrier)
    for _ in range(args.compute_steps):
        x, y = next(it)
        with model.no_sync():
            t0 = rec.clock()
            task.loss_fn(model(x), y).backward()
            rec.compute_only_ms.append((rec.clock() - t0) * 1e3)
        optimizer.zero_grad(set_to_none=True)
    rec.comm_bytes_per_step = float(grad_payload_bytes(net))
    tail = [loss for _, loss in rec.loss_curve[-max(1, args.steps):]]
    mean_loss = torch.tensor(sum(tail) / len(tail), dtype=torch.float64)
    dist.all_reduce(mean_loss)
    rec.final_loss = mean_loss.item() / world
    if task.test_set is not None:
        rec.test_acc = _accuracy(net, task, device)  # the whole test set on every rank
    rec.finish()
    rec.write(args.out)
    model = None  # drop the last reference: a DDP object outliving its gloo group can abort the process at exit (torch 2.13)
    gc.collect()
    destroy_process_group()


@torch.no_grad()
def _accuracy(net: torch.nn.Module, task, device: torch.device) -> float:
    net.eval()
    scores = [task.metric(net(x.to(device)), y.to(device)) for x, y in DataLoader(task.test_set, batch_size=256)]
    return torch.cat(scores).mean().item()


if __name__ == "__main__":
    import faulthandler

    from torch.distributed.elastic.multiprocessing.errors import record

    faulthandler.enable()  # a rank killed by a signal (a backend's abort) still says where
    # record: torchrun's failure summary then carries this rank's exception, not only "ChildFailedError".
    record(main)()
