"""The batch split by rank speed (dtrain.data.split, split_sampler): the arithmetic, the sampler's
exactly-once over an epoch with uneven and changing shares, its resume mid-epoch, and the loss
weight that keeps the update the even split's."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.data.loader import DeviceLoader, reshard
from dtrain.data.split import (
    DriftGate,
    SplitSchedule,
    SplitSpec,
    check_shares,
    loss_weight,
    predicted_ms,
    shares_for,
    weighted,
)
from dtrain.data.split_sampler import split_loader
from dtrain.errors import ConfigError


def test_spec_parses_modes_and_shares():
    assert SplitSpec.parse("even").mode == "even"
    assert SplitSpec.parse(" Speed ").mode == "speed"
    fixed = SplitSpec.parse("40,24")
    assert (fixed.mode, fixed.shares, str(fixed)) == ("fixed", (40, 24), "40,24")


@pytest.mark.parametrize("text, says", [("40,0", "rank 1 would get zero samples"), ("fast", "is not even, speed"),
                                        ("40", "is not even, speed"), ("4.5,3", "is not even, speed")])
def test_spec_refuses(text, says):
    with pytest.raises(ConfigError, match=says):
        SplitSpec.parse(text)


@pytest.mark.parametrize("shares, says", [([40, 24, 0], "gives 3 shares but the job has 2"), ([40, 20], "sums to 60"),
                                          ([41, 23], "not a positive multiple of --grad-accum 2")])
def test_fixed_shares_checked_against_the_job(shares, says):
    with pytest.raises(ConfigError, match=says):
        check_shares(shares, global_batch=64, world_size=2, unit=2)
    assert check_shares([40, 24], global_batch=64, world_size=2, unit=2) == [40, 24]


def test_shares_follow_speed_and_keep_every_rule():
    # Rank 1 takes twice as long per sample: about a third of the batch.
    assert shares_for(64, [1.0, 2.0], [0.0, 0.0]) == [43, 21]
    # Fixed costs count: a rank with a slow optimizer step takes fewer samples.
    assert shares_for(64, [1.0, 1.0], [0.0, 10.0]) == [37, 27]
    # Units (grad-accum 4): multiples of 4, at least one unit even for a hopeless rank.
    out = shares_for(64, [1.0, 1000.0, 1.0], [0.0, 0.0, 0.0], unit=4)
    assert out == [32, 4, 28] and sum(out) == 64 and all(n % 4 == 0 for n in out)
    # The measured split leaves two units where it can (BatchNorm refuses one sample), else one.
    assert shares_for(64, [1.0, 1000.0, 1.0], [0.0, 0.0, 0.0], unit=4, least=2) == [28, 8, 28]
    assert shares_for(12, [1.0, 1000.0, 1.0], [0.0, 0.0, 0.0], unit=4, least=2) == [4, 4, 4]
    assert shares_for(64, [1.0, 1000.0], [0.0, 0.0], least=2) == [62, 2]
    with pytest.raises(ConfigError, match="cannot give 3 ranks 4 sample"):
        shares_for(8, [1.0, 1.0, 1.0], [0.0] * 3, unit=4)
    with pytest.raises(ValueError):
        shares_for(64, [1.0, float("nan")], [0.0, 0.0])


@pytest.mark.parametrize("costs", [([1.0, 1.7, 3.1], [2.0, 0.0, 5.0]), ([0.3, 0.3, 0.9], [0.0, 4.0, 1.0])])
def test_shares_are_the_best_whole_split(costs):
    """Water filling gives the least slowest-rank time of every split into whole units."""
    per, fixed = costs
    best = min(predicted_ms(s, per, fixed) for s in itertools.product(range(2, 31, 2), repeat=3) if sum(s) == 30)
    got = shares_for(30, per, fixed, unit=2)
    assert predicted_ms(got, per, fixed) == pytest.approx(best)


def test_schedule_by_step_and_its_state():
    sched = SplitSchedule([32, 32])
    sched.change(6, [40, 24])
    sched.change(20, [44, 20])
    assert [sched.at(s) for s in (1, 5, 6, 19, 20, 99)] == [[32, 32]] * 2 + [[40, 24]] * 2 + [[44, 20]] * 2
    again = SplitSchedule.from_state(sched.state())
    assert again.entries == sched.entries


# -- the sampler --------------------------------------------------------------------------------

N, B, W = 203, 8, 3   # 203 samples, batch 8 on 3 ranks: G = 24, 8 steps, 11 left out (drop_last)


def _loaders(shares=None, world=W, n=N, batch=B, seed=5):
    data = TensorDataset(torch.arange(n), torch.zeros(n))
    out = []
    for r in range(world):
        base = reshard(DataLoader(data, batch_size=batch, shuffle=True, drop_last=True), rank=r, world_size=world, seed=seed)
        even = DeviceLoader(base, torch.device("cpu"), on_last=lambda last: None, world_size=world)
        out.append(split_loader(even, shares))
    return out


def _even_steps(world=W, n=N, batch=B, seed=5):
    """Each step's set of samples under the even split."""
    data = TensorDataset(torch.arange(n), torch.zeros(n))
    per_rank = []
    for r in range(world):
        base = reshard(DataLoader(data, batch_size=batch, shuffle=True, drop_last=True), rank=r, world_size=world, seed=seed)
        per_rank.append([set(x.tolist()) for x, _ in base])
    return [set().union(*step) for step in zip(*per_rank)]


def _epoch(loaders, change=None):
    """One epoch of every rank in lockstep; ``change``: (at step, from step, shares)."""
    steps, ledger = [], []
    for s, batches in enumerate(zip(*loaders), start=1):
        steps.append([x.tolist() for x, _ in batches])
        ledger.append([ld.last_batch for ld in loaders])
        if change and s == change[0]:
            for ld in loaders:
                ld.schedule.change(change[1], change[2])
    return steps, ledger


def test_uneven_shares_train_every_sample_once_with_the_even_steps():
    loaders = _loaders([10, 6, 8])
    steps, ledger = _epoch(loaders, change=(3, 4, [4, 12, 8]))
    assert len(steps) == len(loaders[0]) == loaders[0].full_epoch_len() == N // (B * W)
    assert [len(b) for b in steps[0]] == [10, 6, 8] and [len(b) for b in steps[-1]] == [4, 12, 8]
    flat = [i for step in steps for b in step for i in b]
    assert len(flat) == len(set(flat)) == len(steps) * B * W  # exactly once
    assert [set().union(*map(set, step)) for step in steps] == _even_steps()  # the even split's samples per step
    # The ledger's view: each step's indices, and on the last what drop_last left (rank 0 names it).
    assert all(rec[1] == b for recs, step in zip(ledger, steps) for rec, b in zip(recs, step))
    last = ledger[-1]
    assert len(set(last[0][2]) - set(flat)) == N - len(flat) and last[1][2] == []  # (the tail holds the order's pad)
    assert all(rec[2] is None for recs in ledger[:-1] for rec in recs)


def test_resume_mid_epoch_continues_the_same_batches():
    whole, _ = _epoch(_loaders([10, 6, 8]), change=(2, 3, [6, 6, 12]))
    first = _loaders([10, 6, 8])
    for ld in first:
        ld.schedule.change(3, [6, 6, 12])
    its = [iter(ld) for ld in first]
    done = [[next(it)[0].tolist() for it in its] for _ in range(4)]
    state = first[0].state_dict()
    assert state["samples_consumed"] == 4 * B * W and state["split"]["schedule"] == [[0, [10, 6, 8]], [3, [6, 6, 12]]]
    resumed = _loaders(None)  # a speed split starts even: the checkpoint's shares hold
    for ld in resumed:
        ld.load_state_dict(state)
        ld.start_step(4)
        assert ld.restored
    rest, _ = _epoch(resumed)
    assert done + rest == whole
    fixed = _loaders([8, 8, 8])[0]  # shares given now hold over a checkpoint's
    fixed.load_state_dict(state)
    assert not fixed.restored and fixed.schedule.entries == [(0, [8, 8, 8])]


def test_another_world_size_starts_even():
    state = _loaders([10, 6, 8])[0].state_dict()
    other = _loaders(None, world=2)[0]
    other.load_state_dict(state)
    assert not other.restored and other.schedule.last == [B, B]


def test_keyed_data_sets_get_keys():
    class Keyed(TensorDataset):
        epoch_keyed = True

        def __getitem__(self, key):
            return torch.tensor(key[2]), torch.tensor(0.0)

    data = Keyed(torch.arange(40))
    base = reshard(DataLoader(data, batch_size=4, shuffle=True, drop_last=True), rank=1, world_size=2, seed=1)
    ld = split_loader(DeviceLoader(base, torch.device("cpu"), on_last=lambda last: None, world_size=2), [5, 3])
    x, _ = next(iter(ld))
    assert x.tolist() == ld.last_batch[1] and len(x) == 3


# -- the loss weight ----------------------------------------------------------------------------

def _grads(model, loss_fn, x, y):
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("shares, k", [([40, 24], 1), ([40, 24], 2), ([12, 4, 32, 16], 4)])
def test_weighted_update_equals_the_even_split(shares, k):
    """Ranks' micro-batches weighted, each divided by k (ctx.backward) and averaged over the ranks
    (DDP) give the gradient of the mean over the global batch; unweighted they do not."""
    torch.manual_seed(0)
    g, world = sum(shares), len(shares)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(g, 6, dtype=torch.float64), torch.randint(0, 3, (g,))
    reference = _grads(model, nn.functional.cross_entropy, x, y)

    def ddp(loss_fn):
        total, first = torch.zeros_like(reference), 0
        for n in shares:
            xs, ys = x[first:first + n], y[first:first + n]
            first += n
            for xm, ym in zip(xs.chunk(k), ys.chunk(k)):
                total += _grads(model, lambda out, t: loss_fn(out, t) / k, xm, ym)
        return total / world

    loss = weighted(nn.functional.cross_entropy, lambda: k, world_size=world, global_batch=g)
    assert torch.allclose(ddp(loss), reference, rtol=0, atol=1e-12)
    assert not torch.allclose(ddp(nn.functional.cross_entropy), reference, rtol=0, atol=1e-6)


def test_even_weight_is_exactly_one():
    assert loss_weight(16, 2, 4, 128) == 1.0


class _TwoRanks:
    """Two ranks in one process for the split's listener: rank r's forward takes
    ``fixed[r] + n * per[r]`` ms with ``n`` its share of the step measured; optimizer 1 ms."""

    is_main, device = False, torch.device("cpu")

    def __init__(self, loader, fixed, per):
        from types import SimpleNamespace

        self.loader, self.fixed, self.per = loader, fixed, per
        self.breakdown = SimpleNamespace(recent=lambda n: None)
        self.step = 0

    def all_gather(self, t):
        from dtrain.metrics.breakdown import pack, stats

        shares = self.loader.schedule.at(self.step - 1)  # the measured steps ran with these
        return [torch.tensor([*pack(stats([(0.0, f + n * c, 0.0, 0.0, 1.0, 0.0)] * 4)), float(self.loader.batch_sampler.next_step)],
                             dtype=torch.float64) for f, c, n in zip(self.fixed, self.per, shares)]


def test_a_cost_that_does_not_shrink_with_the_batch_is_found_by_the_second_point():
    """Rank 1's forward holds 30 ms whatever its batch (a sleep, buckets all-reduced on its core):
    one measurement reads it as per sample and gives rank 1 too many samples; the two-point fit
    finds the fixed part and the split that makes both ranks finish together."""
    from dtrain.metrics.stragglers import StragglerConfig
    from dtrain.train.listeners import LoopState
    from dtrain.train.listeners.batch_split import BatchSplit, fit_line

    assert fit_line(32, 62.0, 22, 52.0) == (30.0, 1.0)
    assert fit_line(32, 62.0, 32, 64.0) == (0.0, 2.0)  # one point: all per sample
    assert fit_line(32, 40.0, 22, 52.0) == (0.0, 52.0 / 22)  # a negative slope is noise: the later point alone
    loader = _loaders(world=2, n=64 * 40, batch=32)[0]
    ctx = _TwoRanks(loader, fixed=[0.0, 30.0], per=[1.0, 1.0])
    split = BatchSplit(ctx, loader, measure=True, unit=1, warmup_steps=None, stragglers=StragglerConfig())
    split.on_start(LoopState(step=0, total=40))
    for step in range(1, 40):
        ctx.step, loader.batch_sampler.next_step = step, step + 1
        split.on_step(LoopState(step=step, total=40))
    first, refined = split.changes
    assert first["why"] == "measured after warm-up" and first["new"] == shares_for(64, [1.0, 62 / 32], [1.0, 1.0])
    assert refined["why"] == "refined with a second point" and refined["from_step"] > first["from_step"]
    assert refined["new"] == shares_for(64, [1.0, 1.0], [1.0, 31.0]) == [47, 17]
    assert split.settled(39) and loader.schedule.last == [47, 17]


def test_drift_gate_fires_both_ways_once_until_the_split_is_balanced_again():
    gate = DriftGate()
    assert gate.fires([100.0, 104.0]) is None and gate.armed
    assert gate.fires([100.0, 80.0]) == 1.25  # a rank got faster: 0.8x the other
    gate.changed()
    for noisy in ([100.0, 121.0], [100.0, 119.0], [100.0, 123.0]):  # around the threshold, not balanced: no flapping
        assert gate.fires(noisy) is None
    assert gate.fires([100.0, 109.0]) is None and gate.armed  # balanced: the next drift is followed
    assert gate.fires([130.0, 100.0]) == 1.3
    assert gate.fires([100.0, 0.0]) is None  # a rank without compute figures: nothing to split by


def _run_split(ctx, split, loader, steps, start):
    from dtrain.train.listeners import LoopState

    for step in range(start, start + steps):
        ctx.step, loader.batch_sampler.next_step = step, step + 1
        split.on_step(LoopState(step=step, total=10_000))
    return start + steps


def test_a_rank_that_gets_moderately_faster_is_followed_and_back_again():
    """Rank 1 becomes 1.25x faster: the others' own step is 1.25x rank 1's, under the straggler
    detector's 1.3x, so the old rule kept the split; the drift gate re-measures it, once, and
    follows the change back when rank 1 slows again."""
    from dtrain.metrics.stragglers import StragglerConfig
    from dtrain.train.listeners import LoopState
    from dtrain.train.listeners.batch_split import BatchSplit

    loader = _loaders(world=2, n=64 * 200, batch=32)[0]
    ctx = _TwoRanks(loader, fixed=[0.0, 0.0], per=[1.0, 1.0])
    split = BatchSplit(ctx, loader, measure=True, unit=1, warmup_steps=None, stragglers=StragglerConfig(window=10))
    split.on_start(LoopState(step=0, total=10_000))
    step = _run_split(ctx, split, loader, 30, 1)
    assert loader.schedule.last == [32, 32] and not split.changes  # equal speeds: even stays
    ctx.per = [1.0, 0.8]
    step = _run_split(ctx, split, loader, 30, step)
    assert len(split.changes) == 1 and "drifted 1.24x apart" in split.changes[0]["why"]
    assert loader.schedule.last == shares_for(64, [1.0, 0.8], [1.0, 1.0]) == [28, 36]  # 1 ms optimizer: fixed
    step = _run_split(ctx, split, loader, 60, step)
    assert len(split.changes) == 1  # balanced now (29 / 29.8 ms): no flapping
    ctx.per = [1.0, 1.0]
    _run_split(ctx, split, loader, 30, step)
    assert len(split.changes) == 2 and loader.schedule.last == [32, 32]


def test_a_first_split_left_apart_is_corrected_at_the_first_drift_check():
    """The gate is armed from the start: a drift before any balanced window (here right after the
    first measurement) is followed at the first check, not only after the split was seen balanced."""
    from dtrain.metrics.stragglers import StragglerConfig
    from dtrain.train.listeners import LoopState
    from dtrain.train.listeners.batch_split import BatchSplit

    loader = _loaders(world=2, n=64 * 200, batch=32)[0]
    ctx = _TwoRanks(loader, fixed=[0.0, 0.0], per=[1.0, 1.0])
    split = BatchSplit(ctx, loader, measure=True, unit=1, warmup_steps=None, stragglers=StragglerConfig(window=10))
    split.on_start(LoopState(step=0, total=10_000))
    step = _run_split(ctx, split, loader, 6, 1)
    assert not split.changes and split.next_check == 15  # measured at step 5: 32/32 stays
    ctx.per = [1.0, 0.8]
    _run_split(ctx, split, loader, 10, step)
    assert len(split.changes) == 1 and split.changes[0]["step"] == 15 and loader.schedule.last == [28, 36]
