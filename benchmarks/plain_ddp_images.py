"""A plain torchrun + DDP + torchvision ResNet script, of the kind the seed project shipped for
ImageNet (pytorch/examples' imagenet main.py, reduced): no dtrain anywhere. The baseline of
images_vs_plain.py; prints one JSON line with the global samples/s.

    torchrun --nproc-per-node 2 benchmarks/plain_ddp_images.py --data-dir DIR --size 64 --max-steps 30
    torchrun --nproc-per-node 2 benchmarks/plain_ddp_images.py --synthetic --size 64 --max-steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class Synthetic(Dataset):
    """Random images from a pool of 64, random labels: no decoding (Horovod's synthetic benchmark)."""

    def __init__(self, samples: int, size: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(64, 3, size, size, generator=g)
        self.labels = torch.randint(0, classes, (64,), generator=g)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        return self.images[i % 64], self.labels[i % 64]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.1)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if a.synthetic:
        data, classes = Synthetic(a.samples, a.size, a.classes), a.classes
    else:
        normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        data = torchvision.datasets.ImageFolder(
            os.path.join(a.data_dir, "train"),
            T.Compose([T.RandomResizedCrop(a.size), T.RandomHorizontalFlip(), T.ToTensor(), normalize]),
        )
        classes = len(data.classes)
    model = DistributedDataParallel(torchvision.models.resnet18(num_classes=classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    extra = {"persistent_workers": True, "prefetch_factor": 2} if a.workers else {}
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, drop_last=True, num_workers=a.workers, **extra)
    model.train()
    step, epoch = 0, 0
    t0 = time.perf_counter()
    while step < a.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step >= a.max_steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"samples_per_s": round(step * a.batch_size * world / elapsed, 2), "steps": step, "loss": loss.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
