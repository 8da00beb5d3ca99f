"""The GPU fast path's choices and the input path (issue 28, items 4 and 5), tested on a CPU
machine: a CUDA ``torch.device`` stands in for the GPU (the choices are pure functions of it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dtrain.data.loader import DeviceLoader, reshard
from dtrain.data.plan import PREFETCH_BUDGET_BYTES, plan_input
from dtrain.precision import Precision, auto_precision
from dtrain.strategies.base import Capabilities
from dtrain.tasks import make_optimizer
from dtrain.world.fastpath import auto_channels_last, optimizer_options

CUDA = torch.device("cuda", 0)  # never touched: only its type is read
CPU = torch.device("cpu")


class Decoded(Dataset):
    """Stands in for an image folder: samples that must be decoded (not in memory)."""

    def __init__(self, n: int = 64, shape: tuple[int, ...] = (3, 8, 8)) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.zeros(self.shape), i % 2


def test_decoded_data_on_a_gpu_gets_workers_and_pinned_memory():
    plan = plan_input(Decoded(), local_size=1, device=CUDA, batch_size=32, cpus=16)
    assert (plan.workers, plan.pin_memory, plan.prefetch_factor) == (8, True, 2)
    # One core per GPU process: still a worker (the training process mostly waits for the GPU).
    tight = plan_input(Decoded(), local_size=2, device=CUDA, batch_size=32, cpus=2)
    assert (tight.workers, tight.prefetch_factor) == (1, 4)
    # The same on a CPU: the process computes on its one core, no worker.
    assert plan_input(Decoded(), local_size=2, device=CPU, batch_size=32, cpus=2).workers == 0
    assert plan_input(Decoded(), local_size=1, device=CPU, batch_size=32, cpus=2).pin_memory is False


def test_data_in_memory_or_on_the_device_gets_no_workers():
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    assert plan_input(data, local_size=1, device=CUDA, batch_size=4, cpus=16).workers == 0
    assert plan_input(_synthetic(), local_size=1, device=CUDA, batch_size=4, cpus=16).workers == 0
    assert plan_input(data, local_size=1, device=CUDA, batch_size=4, workers=3, cpus=16).workers == 3  # --num-workers wins


def test_big_samples_keep_fewer_batches_in_flight():
    big = 3 * 1024 * 1024 * 4  # a 3x1024x1024 float image
    plan = plan_input(Decoded(), local_size=1, device=CUDA, batch_size=64, cpus=16, sample_bytes=big)
    assert plan.prefetch_factor == max(1, PREFETCH_BUDGET_BYTES // (big * 64 * 8))
    assert plan.prefetch_factor * plan.workers * 64 * big <= PREFETCH_BUDGET_BYTES or plan.prefetch_factor == 1
    declared = Decoded()
    declared.sample_bytes = big  # as the images task declares it for its folder
    assert plan_input(declared, local_size=1, device=CUDA, batch_size=64, cpus=16).prefetch_factor == plan.prefetch_factor


def _synthetic():
    pytest.importorskip("torchvision")
    from dtrain.tasks.images import SyntheticImages

    return SyntheticImages(samples=40, size=16, classes=3)


def test_synthetic_images_hand_out_one_batch_made_once_and_keep_positions(monkeypatch):
    data = _synthetic()
    loader = DeviceLoader(reshard(DataLoader(data, batch_size=8, shuffle=True), rank=0, world_size=1, seed=0), CPU,
                          on_last=lambda flag: None)

    def no_fetch(self, index):
        raise AssertionError("a sample was fetched: the synthetic batch should be made once")

    monkeypatch.setattr(type(data), "__getitem__", no_fetch)
    batches = list(loader)
    assert len(batches) == 5 and all(b is batches[0] for b in batches)
    x, y = batches[0]
    assert x.shape == (8, 3, 16, 16) and y.shape == (8,)
    assert loader.state_dict() == {"epoch": 1, "samples_consumed": 0, "seed": 0}  # the epoch ran to its end
    assert loader.next_epoch == 1


def test_fused_optimizers_on_cuda_only():
    assert optimizer_options("adamw", CUDA) == {"fused": True}
    assert optimizer_options("sgd", CUDA) == {"fused": True}
    assert optimizer_options("adadelta", CUDA) == {}
    assert optimizer_options("adamw", CPU) == {}
    opt = make_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), 0.1, device=CPU)
    assert not opt.defaults.get("fused")


def test_auto_precision_is_bf16_where_the_gpu_has_it():
    assert auto_precision(CUDA, bf16_supported=True) == "bf16-mixed"
    assert auto_precision(CUDA, bf16_supported=False) == "fp32"
    assert auto_precision(CPU) == "fp32"
    assert Precision.resolve("auto", CPU).effective == "fp32"


class _Strategy:
    def __init__(self, sharded: bool) -> None:
        self.capabilities = Capabilities(sharded_params=sharded)


def test_channels_last_for_conv_nets_on_cuda_unless_sharded():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    mlp = torch.nn.Linear(4, 2)
    assert auto_channels_last(conv, CUDA, _Strategy(False))
    assert not auto_channels_last(conv, CUDA, _Strategy(True))  # fully_shard: contiguous parameters only
    assert not auto_channels_last(mlp, CUDA, _Strategy(False))
    assert not auto_channels_last(conv, CPU, _Strategy(False))


def test_compile_goes_per_block_only_where_the_layout_needs_it():
    from dtrain.parallel.transforms import compile_per_block

    assert not compile_per_block(Capabilities(), activation_checkpointing=False)  # single, ddp: the whole model
    assert compile_per_block(Capabilities(sharded_params=True), activation_checkpointing=False)  # fsdp, hsdp
    assert compile_per_block(Capabilities(staged_step=True), activation_checkpointing=False)  # pipeline
    assert compile_per_block(Capabilities(), activation_checkpointing=True)


def test_fast_compiles_on_cuda_only(monkeypatch):
    from dtrain.world import fastpath

    assert fastpath.compile_pays("cuda") and fastpath.compile_pays("cuda:1")
    assert not fastpath.compile_pays("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fastpath.compile_pays(None)
