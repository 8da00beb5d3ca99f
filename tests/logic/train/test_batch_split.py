"""The batch split's listener (dtrain.train.listeners.batch_split): what it refuses, the split it
measures after warm-up, and the re-split when a straggler is named, on a fake two-rank context
whose gathered breakdowns the test writes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dtrain.data.loader import DeviceLoader, reshard
from dtrain.errors import ConfigError
from dtrain.metrics.breakdown import pack
from dtrain.metrics.stragglers import StragglerConfig
from dtrain.strategies.base import Capabilities
from dtrain.train.config import BatchConfig, ObserveConfig, TrainConfig
from dtrain.train.listeners import LoopState
from dtrain.train.listeners.batch_split import attach
from dtrain.train.listeners.batch_split import costs as split_costs


def _window(per_sample_ms: float, samples: int, fixed_ms: float = 1.0, steps: int = 4, *, backward_ms: float = 0.0,
            comm_ms: float = 0.0) -> dict:
    fwd = per_sample_ms * samples / 2
    med = {"data_wait": 0.0, "forward": fwd, "backward": fwd + backward_ms, "comm": comm_ms, "optimizer": fixed_ms, "rest": 0.0}
    med["step"] = sum(med.values())
    med["own"] = med["step"]
    return {"steps": steps, "median_ms": med, "p90_ms": dict(med)}


class FakeCtx:
    """Rank 0 of ``world`` ranks; ``speeds[r]``: rank r's ms per sample, read at each gather."""

    def __init__(self, world=2, *, staged=False, comm="none", dp=None):
        self.rank, self.is_main, self.device = 0, True, torch.device("cpu")
        self.world_size, self.data_parallel_size = world, dp or world
        self.strategy = SimpleNamespace(name="fake", capabilities=Capabilities(staged_step=staged),
                                        comm_record=lambda: {"comm": comm})
        self.accumulation_steps = 1
        self.speeds = [1.0] * world
        self.loader = None
        self.breakdown = SimpleNamespace(recent=lambda n: None)
        self.gathers = 0
        self.windows = None
        """Optional: shares -> each rank's window, for costs other than ``speeds``' straight lines."""

    def all_gather(self, t):
        self.gathers += 1
        step = self.loader.batch_sampler.next_step
        shares = self.loader.schedule.at(step - 1)
        windows = self.windows(shares) if self.windows else [_window(c, n) for c, n in zip(self.speeds, shares)]
        return [torch.tensor([*pack(w), float(step)], dtype=torch.float64) for w in windows]


def _setup(split="speed", world=2, batch=32, **ctx_kw):
    ctx = FakeCtx(world, **ctx_kw)
    cfg = TrainConfig(batch=BatchConfig(size=batch, split=split), observe=ObserveConfig(stragglers=StragglerConfig(window=10)))
    data = TensorDataset(torch.arange(4096), torch.zeros(4096))
    base = reshard(DataLoader(data, batch_size=batch, shuffle=True, drop_last=True), rank=0, world_size=world, seed=0)
    even = DeviceLoader(base, torch.device("cpu"), on_last=lambda last: None, world_size=world)
    task = dataclasses.make_dataclass("T", [("loss_fn", object)], frozen=True)(torch.nn.functional.cross_entropy)
    loader, task, listener = attach(ctx, cfg, task, even, batch)
    ctx.loader = loader
    return ctx, loader, task, listener


class _Run:
    """The loop's side: one start, then steps on demand (one epoch of the loader is plenty)."""

    def __init__(self, loader, listener):
        self.listener, self.state = listener, LoopState(step=0, total=10**6)
        listener.on_start(self.state)
        self.it = iter(loader)

    def steps(self, n):
        for _ in range(n):
            next(self.it)
            self.state.step += 1
            self.listener.on_step(self.state)


def test_even_changes_nothing():
    ctx, loader, task, listener = _setup("even")
    assert listener is None and task.loss_fn is torch.nn.functional.cross_entropy and type(loader) is DeviceLoader


def test_speed_split_after_warm_up_then_follows_a_drift():
    ctx, loader, task, listener = _setup("speed")
    ctx.speeds = [1.0, 2.0]  # rank 1 twice as slow per sample
    run = _Run(loader, listener)
    run.steps(5)  # measured at step 5 (4 warm-up steps, the first apart)
    assert ctx.gathers == 1 and loader.schedule.entries == [(0, [32, 32]), (6, [43, 21])]
    assert listener.changes[0]["old"] == [32, 32] and listener.changes[0]["new"] == [43, 21]
    run.steps(15)
    # steps 6-20: the refinement's gather (step 12) and one drift check (step 16); equal fixed costs leave the split
    assert len(loader.schedule.entries) == 2 and ctx.gathers == 3 and len(listener.changes) == 1
    ctx.speeds = [4.0, 2.0]  # rank 0 slows down: it is named, and the split follows
    run.steps(20)
    new = loader.schedule.last
    # named by the drift gate (4x apart) in the window the fake's detector is still filling
    assert new[0] < new[1] and sum(new) == 64 and listener.changes[-1]["why"].startswith("re-measured: ")


def _bent(shares, *, slow_below=0, comm_ms=0.0):
    """Rank 0 1 ms a sample; rank 1 20 ms + 2 ms a sample (a fixed part the first, one-point
    measurement cannot see); with ``slow_below``, a cost the model does not know (30 ms more in
    every rank's step, as exposed communication) whenever rank 1 has fewer samples than that."""
    extra = comm_ms if shares[1] < slow_below else 0.0
    return [_window(1.0, shares[0], comm_ms=extra), _window(2.0, shares[1], backward_ms=20.0, comm_ms=extra)]


def _refined_run(**bent):
    ctx, loader, task, listener = _setup("speed")
    ctx.windows = lambda shares: _bent(shares, **bent)
    run = _Run(loader, listener)
    run.steps(5)  # measured: 32/32 -> 47/17 from step 6 (rank 1 read as 2.625 ms a sample)
    run.steps(7)  # refined at step 12 from the line through both points: 47/17 -> 50/14 from step 13
    assert [c["new"] for c in listener.changes] == [[47, 17], [50, 14]] and not listener.settled(12)
    return ctx, loader, listener, run


def test_a_refined_split_that_measures_slower_is_undone():
    ctx, loader, listener, run = _refined_run(slow_below=16, comm_ms=30.0)  # 50/14 costs 30 ms the lines cannot see
    run.steps(7)  # its 6 steps (13-18) read at step 19: 81 ms a step against 47/17's 55 ms
    assert loader.schedule.last == [47, 17] and loader.schedule.entries[-1][0] == 20
    assert listener.changes[-1]["why"] == "the refined split measured slower" and listener.settled(19)


def test_a_refined_split_that_measures_faster_is_kept():
    ctx, loader, listener, run = _refined_run()  # the lines were right: 51 ms a step against 55
    gathers = ctx.gathers
    run.steps(7)
    assert ctx.gathers == gathers + 1 and loader.schedule.last == [50, 14] and len(listener.changes) == 2
    assert listener.settled(19)


def test_weighted_loss_replaces_the_tasks():
    ctx, loader, task, listener = _setup("40,24")
    out, y = torch.randn(40, 3), torch.randint(0, 3, (40,))
    assert torch.allclose(task.loss_fn(out, y), torch.nn.functional.cross_entropy(out, y) * 1.25)
    assert loader.schedule.last == [40, 24] and not listener.measure


@pytest.mark.parametrize("kw, split, says", [
    ({"staged": True}, "speed", "needs every rank to read its own batch"),
    ({"dp": 1}, "speed", "has 1 data-parallel replica"),
    ({"comm": "localsgd:16"}, "40,24", "local SGD averages parameters"),
    ({"comm": "auto"}, "speed", "--comm auto"),
])
def test_refuses_what_cannot_take_uneven_batches(kw, split, says):
    with pytest.raises(ConfigError, match=says):
        _setup(split, **kw)


def test_refuses_speed_without_the_breakdown():
    ctx = FakeCtx()
    cfg = TrainConfig(batch=BatchConfig(size=32, split="speed"), observe=ObserveConfig(breakdown=False))
    with pytest.raises(ConfigError, match="drop --no-breakdown"):
        attach(ctx, cfg, SimpleNamespace(loss_fn=None), None, 32)


def test_costs_split_per_sample_and_fixed():
    per, fixed = split_costs([_window(2.0, 40, fixed_ms=3.0), _window(1.0, 24)], [40, 24])
    assert per == pytest.approx([2.0, 1.0]) and fixed == pytest.approx([3.0, 1.0])
    with pytest.raises(ValueError):
        split_costs([None, _window(1.0, 24)], [40, 24])


def test_refused_with_micro_batch_auto_and_bad_shares_at_the_flag():
    from dtrain.train.microbatch import AutoMicro

    with pytest.raises(ConfigError, match="--batch-split speed with --micro-batch auto"):
        BatchConfig(size=32, split="speed", micro=AutoMicro())
    with pytest.raises(ConfigError, match="rank 1 would get zero samples"):
        BatchConfig(size=32, split="64,0")
