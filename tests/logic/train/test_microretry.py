"""--micro-batch auto after the first batch (dtrain.train.microretry): a step that runs out of memory
on any rank is agreed, its gradients dropped, its buffers and random state put back, and retried
smaller; the gradients it leaves are a clean run's at the smaller micro-batch."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.train.microbatch import AutoMicro, Budget, Fitter
from dtrain.train.microretry import Guard, average_gradients


class _Strategy:
    name = "ddp"

    def no_sync(self, model):
        return contextlib.nullcontext()


class _Peer:
    """Rank 0 of two; the peer runs out of memory at a try of more than ``limit`` samples per
    micro-step (its flag added by the all-reduce); its gradients equal this rank's."""

    def __init__(self, limit: int) -> None:
        self.rank, self.world_size, self.device, self.is_main = 0, 2, torch.device("cpu"), True
        self.strategy, self.limit, self.m = _Strategy(), limit, 0
        self.world = type("W", (), {"distributed": True})()
        self._step = type("S", (), {"micro_step": 0})()
        self.flags = self.means = 0
        self.peer_error = False

    def all_reduce(self, t, op="mean"):
        if op == "sum":  # the flags (the peer's status at the try's micro-batch), maybe with gradients (the peer's equal)
            self.flags += 1
            peer = t.clone()
            peer[:2] = torch.tensor([0.0, 2.0 if self.peer_error else float(self.m > self.limit)])
            return t + peer
        self.means += op == "mean"
        return t  # min of equal proposals; the mean of equal gradients


class _Net(nn.Module):
    def __init__(self, syncs_buffers: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
        self.syncs = syncs_buffers

    def forward(self, x):
        return self.net(x)

    def will_sync_module_buffers(self):  # as DDP's, when it broadcasts buffers in forward
        return self.syncs


def _micro(ctx, model, seen):
    def run(xm, ym, k):
        ctx.m = len(xm)
        seen.append(len(xm))
        loss = nn.functional.cross_entropy(model(xm), ym)
        (loss / k).backward()
        return loss.detach()
    return run


def _guard(ctx, model, budget=None, from_step=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fitter = Fitter(ctx, model, opt, nn.functional.cross_entropy, 32, AutoMicro())
    return Guard(ctx, model, opt, fitter, budget, from_step), opt


def _clean_grads(model, x, y, m):
    """The gradients and buffers of a run that took micro-batches of ``m`` at this step."""
    ref = copy.deepcopy(model)
    seen: list[int] = []
    ctx = _Peer(limit=10**6)
    for xm, ym in zip(x.chunk(32 // m), y.chunk(32 // m)):
        _micro(ctx, ref, seen)(xm, ym, 32 // m)
    return {n: p.grad.clone() for n, p in ref.named_parameters()}, {n: b.clone() for n, b in ref.named_buffers()}


def test_a_peer_out_of_memory_at_a_later_step_is_retried_smaller_and_leaves_a_clean_runs_gradients(caplog):
    torch.manual_seed(0)
    ctx, model = _Peer(limit=32), _Net()
    guard, opt = _guard(ctx, model)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    seen: list[int] = []
    guard.step(0, x, y, _micro(ctx, model, seen))
    assert guard.fitter.accumulation == 1 and seen == [32]  # the step (the trial ran the model itself)
    opt.step()
    opt.zero_grad()
    ctx.limit, seen[:] = 8, []  # a later step needs more memory on the peer
    rng = torch.get_rng_state()
    want_grads, want_buffers = _clean_grads(model, x, y, 8)
    torch.set_rng_state(rng)  # dropout: the retry must draw what a run at 8 draws
    with caplog.at_level(logging.INFO, logger="dtrain"):
        loss = guard.step(1, x, y, _micro(ctx, model, seen))
    assert seen == [32, 16, 16, 8, 8, 8, 8] and guard.fitter.accumulation == 4 and torch.isfinite(loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-6, atol=1e-7, msg=n)  # the failed tries' gradients dropped
    for n, b in model.named_buffers():
        assert torch.equal(b, want_buffers[n]), n  # BatchNorm's statistics: the failed tries' forwards undone
    assert ctx._step.micro_step == 0
    assert guard.record()["micro_batch_retries"] == [[1, 32, 8]] and guard.record()["micro_batch"] == 8
    line = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(line) == 1 and "step 1 ran out of memory, micro-batch 32 -> 8" in line[0], line
    assert "32 (out of memory on rank 1), 16 (out of memory on rank 1)" in line[0], line
    seen[:] = []
    flags, means = ctx.flags, ctx.means
    guard.step(2, x, y, _micro(ctx, model, seen))
    assert seen == [8, 8, 8, 8]  # kept from now on
    assert (ctx.flags - flags, ctx.means - means) == (1, 0)  # one collective a step: the flag with the gradients


def test_this_ranks_own_out_of_memory_from_a_step_on_is_retried():
    ctx, model = _Peer(limit=10**6), _Net()
    guard, _ = _guard(ctx, model, budget=Budget(4_000), from_step=1)  # the fake device: steps from 1 on
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    seen: list[int] = []
    guard.step(0, x, y, _micro(ctx, model, seen))
    assert seen == [32] and not guard.retries  # no fake device for the trial, nor step 0
    for p in model.parameters():
        p.grad = None
    seen[:] = []
    guard.step(1, x, y, _micro(ctx, model, seen))
    assert seen[0] == 32 and guard.fitter.accumulation > 1 and guard.retries[0][:2] == (1, 32)


def test_with_buffers_broadcast_in_forward_the_flag_is_agreed_before_each_micro_step():
    ctx, model = _Peer(limit=4), _Net(syncs_buffers=True)
    guard, _ = _guard(ctx, model)
    guard.fitter.accumulation = 4  # as if the search had found 8
    seen: list[int] = []
    guard.step(3, torch.randn(32, 4), torch.randint(0, 2, (32,)), _micro(ctx, model, seen))
    # the peer fails its first micro-step of 8: this rank learns it before its second, and stops
    assert seen == [8, 4, 4, 4, 4, 4, 4, 4, 4] and guard.retries == [(3, 8, 4)]
    assert ctx.flags == 1 + 8  # the failed try: one, before its second micro-step; the retry: before each of 2..8, and at the end


def test_one_sample_not_fitting_is_one_line_and_another_error_is_raised_on_every_rank():
    ctx, model = _Peer(limit=0), _Net()
    guard, _ = _guard(ctx, model)
    guard.fitter.accumulation = 16
    with pytest.raises(ConfigError, match=r"step 5 ran out of memory on cpu even at one sample per micro-step \(rank\(s\) 1\)"):
        guard.step(5, torch.randn(32, 4), torch.randint(0, 2, (32,)), _micro(ctx, nn.Linear(4, 2), []))
    ctx = _Peer(limit=100)
    ctx.peer_error = True
    guard, _ = _guard(ctx, model)
    guard.fitter.accumulation = 1
    with pytest.raises(ConfigError, match=r"step 2 failed on rank\(s\) 1 with an error other than out-of-memory"):
        guard.step(2, torch.randn(32, 4), torch.randint(0, 2, (32,)), _micro(ctx, model, []))


def test_gradients_are_averaged_in_buckets_and_a_missing_one_sent_as_zeros(monkeypatch):
    import dtrain.train.microretry as retry

    class _Sum:
        world = type("W", (), {"distributed": True})()
        sizes: list[int] = []

        def all_reduce(self, t, op="mean"):
            self.sizes.append(t.numel())
            return t / 2  # the peer's gradients are zeros
    monkeypatch.setattr(retry, "BUCKET_BYTES", 4 * 40)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # 32 + 8 + 16 + 2 floats
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].bias.grad = None
    ctx = _Sum()
    average_gradients(ctx, model)
    assert ctx.sizes == [40, 18]
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in list(model.parameters())[:3])
    assert torch.equal(model[1].bias.grad, torch.zeros(2))
