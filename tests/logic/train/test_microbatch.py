"""--micro-batch auto (dtrain.train.microbatch): the proposal, the search (halving, bisecting, going
up), the agreement between ranks, the fake device, what a trial leaves behind, and the CLI's refusals."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from dtrain.cli import main as cli_main
from dtrain.errors import ConfigError
from dtrain.options import TestHooks
from dtrain.train.config import BatchConfig
from dtrain.train.microbatch import AutoMicro, Budget, Fitter, Search, budget_for, divisors, propose, settle


def test_the_proposal_is_the_largest_divisor_the_prediction_lets_fit():
    asked = []

    def fits(m):
        asked.append(m)
        return 1000 + 100 * m <= 2000
    assert propose(32, fits) == 8 and asked == [32, 16, 8]  # from the top: 3 predictions, not 32
    assert propose(48, lambda m: m <= 10) == 8
    assert propose(32, lambda m: False) is None
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def _search(batch: int, start: int, limit: int) -> Search:
    s = Search(batch, start)
    settle(s, lambda m: m <= limit)
    return s


def test_a_failed_proposal_halves_then_stops_at_the_first_fit():
    s = _search(32, 32, 8)
    assert s.tried == [(32, False), (16, False), (8, True)] and s.best == 8


def test_a_cautious_proposal_goes_up_and_bisects_back():
    s = _search(64, 8, 16)
    assert s.tried == [(8, True), (32, False), (16, True)] and s.best == 16


def test_bisection_between_a_fit_and_a_failure_on_a_batch_that_is_not_a_power_of_two():
    s = _search(48, 48, 10)
    assert s.tried == [(48, False), (24, False), (12, False), (6, True), (8, True)] and s.best == 8


def test_the_start_is_a_divisor_of_the_batch_within_it():
    assert Search(32, 100).start == 32 and Search(32, 5).start == 4 and Search(12, 0).start == 1


@pytest.mark.parametrize("batch", [1, 7, 12, 32, 48, 60, 64])
def test_the_search_finds_the_largest_divisor_that_fits_from_any_start(batch):
    for limit in range(0, batch + 2):
        for start in {1, max(1, batch // 3), batch}:
            s = _search(batch, start, limit)
            want = max((d for d in divisors(batch) if d <= limit), default=None)
            assert s.best == want, (batch, limit, start, s.tried)
            assert len(s.tried) <= 2 * len(divisors(batch)).bit_length() + 1, (batch, limit, start, s.tried)


def test_the_fake_device_fails_mid_forward_above_its_budget():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    ids = {id(p) for p in model.parameters()}
    with Budget(10**6).watch(0, ids):
        model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(torch.OutOfMemoryError, match="DTRAIN_OOM_INJECT"), Budget(4000).watch(0, ids):
        model(torch.randn(64, 8)).sum().backward()  # 64 x (8 + 64 + 64) floats saved
    with pytest.raises(torch.OutOfMemoryError):
        with Budget(100).watch(200, ids):  # the parameters alone are over it
            pass
    assert budget_for(1, (1, 5, None)).limit == 5 and budget_for(0, (1, 5, None)) is None and budget_for(0, None) is None
    assert budget_for(1, (1, 5, 3)) is None and budget_for(1, (1, 5, 3), steps=True).limit == 5  # @STEP: the steps, not the trials


class _Strategy:
    name = "ddp"

    def no_sync(self, model):
        return contextlib.nullcontext()


class _TwoRanks:
    """Rank 0 of a world of two whose peer runs out of memory above ``peer_limit`` samples: the
    all-reduces add what the peer would (its flag; its proposal)."""

    def __init__(self, peer_limit: int, peer_proposal: int = 10**6) -> None:
        self.rank, self.world_size, self.device, self.is_main = 0, 2, torch.device("cpu"), False
        self.strategy, self.peer_limit, self.peer_proposal = _Strategy(), peer_limit, peer_proposal
        self.trials: list[int] = []
        self.reduces = 0

    def all_reduce(self, t, op="mean"):
        self.reduces += 1
        if op == "min":
            return torch.minimum(t, torch.tensor(float(self.peer_proposal), dtype=t.dtype))
        assert op == "sum" and t.shape == (2,)
        m = self.trials[-1]
        return t + torch.tensor([0.0, float(m > self.peer_limit)])


class _Recorder(nn.Module):
    """A model with a BatchNorm (running statistics change in forward) and a dropout (draws random numbers)."""

    def __init__(self, ctx: _TwoRanks, norm: bool = True) -> None:
        super().__init__()
        self.ctx, self.net = ctx, nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if norm else nn.Identity(), nn.Dropout(0.5),
                                                nn.Linear(8, 2))

    def forward(self, x):
        self.ctx.trials.append(len(x))
        return self.net(x)


def _fitter(ctx, budget=None, auto=AutoMicro(), norm=True):
    model = _Recorder(ctx, norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Fitter(ctx, model, opt, nn.functional.cross_entropy, 32, auto, budget), model


def test_a_peer_out_of_memory_is_agreed_and_every_rank_takes_the_same_smaller_micro_batch():
    ctx = _TwoRanks(peer_limit=8)
    fit, model = _fitter(ctx)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    assert fit.accum(x, y) == 4  # rank 0 never ran out itself: 8 samples x 4 because rank 1 did
    assert fit.search.tried == [(32, False), (16, False), (8, True)] and fit.failed_on == {32: [1], 16: [1], 8: []}
    assert ctx.trials == [32, 16, 8] and ctx.reduces == 4  # the proposal's min, then one flag all-reduce per trial
    assert fit.accum(x, y) == 4 and ctx.trials == [32, 16, 8]  # settled: no more trials
    assert fit.record() == {"micro_batch": 8, "grad_accum": 4, "micro_batch_trials": [[32, False], [16, False], [8, True]],
                            "micro_batch_search_s": fit.record()["micro_batch_search_s"]}
    assert "8 sample(s) per micro-step x 4 accumulated" in fit.line() and "out of memory on rank 1" in fit.line()


def test_the_smallest_proposal_over_the_ranks_is_where_every_rank_starts():
    ctx = _TwoRanks(peer_limit=32, peer_proposal=16)
    fit, _ = _fitter(ctx, auto=AutoMicro(proposal=32))
    fit.accum(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    assert fit.search.tried == [(16, True), (32, True)]


def test_trials_leave_no_gradient_buffer_or_random_state_behind_even_after_an_out_of_memory():
    ctx = _TwoRanks(peer_limit=32)
    fit, model = _fitter(ctx, budget=Budget(2_000))  # this rank's own fake device: fails at 32 samples
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    rng = torch.get_rng_state()
    fit.accum(x, y)
    assert fit.failed_on[32] == [0] and fit.search.best < 32
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "running statistics changed by the trials"
    assert torch.equal(torch.get_rng_state(), rng)


def test_not_even_one_sample_fitting_is_one_line():
    ctx = _TwoRanks(peer_limit=0)
    fit, _ = _fitter(ctx, norm=False)
    with pytest.raises(ConfigError, match=r"one sample per micro-step does not fit on cpu \(out of memory on rank\(s\) 1\)"):
        fit.accum(torch.randn(32, 4), torch.randint(0, 2, (32,)))


def test_another_error_in_a_trial_is_agreed_then_raised_on_every_rank():
    ctx = _TwoRanks(peer_limit=0)  # the peer runs out at 32, 16, ..., 2; at 1 sample BatchNorm refuses here
    fit, _ = _fitter(ctx)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        fit.accum(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    assert ctx.trials[-1] == 1 and ctx.reduces == 1 + len(ctx.trials)  # the flag went out before the error

    class _PeerBroke(_TwoRanks):
        def all_reduce(self, t, op="mean"):
            return t if op == "min" else t + torch.tensor([0.0, 2.0])
    ctx = _PeerBroke(peer_limit=0)
    fit, _ = _fitter(ctx)
    with pytest.raises(ConfigError, match=r"trial of 32 sample\(s\) per micro-step failed on rank\(s\) 1 with an error other"):
        fit.accum(torch.randn(32, 4), torch.randint(0, 2, (32,)))


def test_the_config_refuses_a_grad_accum_of_its_own_and_the_elastic_global_batch():
    with pytest.raises(ConfigError, match="--micro-batch auto chooses the gradient accumulation itself.*--grad-accum 4"):
        BatchConfig(size=32, grad_accum=4, micro=AutoMicro())
    with pytest.raises(ConfigError, match="--elastic-batch global"):
        BatchConfig(size=32, global_batch=128, micro=AutoMicro())


def test_the_oom_variable_is_read_with_its_units():
    assert TestHooks.from_env({"DTRAIN_OOM_INJECT": "1:64MiB"}).oom_inject == (1, 64 * 2**20, None)
    assert TestHooks.from_env({"DTRAIN_OOM_INJECT": "0:1000"}).oom_inject == (0, 1000, None)
    assert TestHooks.from_env({"DTRAIN_OOM_INJECT": "1:2k@3"}).oom_inject == (1, 2048, 3)
    for bad in ("x", "1:", "1:64XB", "a:5", "1:0", "1:5@", "1:5@x"):
        with pytest.raises(ConfigError, match=r"DTRAIN_OOM_INJECT=.* is not RANK:BYTES\[@STEP\]"):
            TestHooks.from_env({"DTRAIN_OOM_INJECT": bad})


@pytest.mark.parametrize("argv, says", [
    (["--micro-batch", "8"], "--micro-batch takes auto, got '8'"),
    (["--micro-batch", "auto", "--grad-accum", "2"], "--micro-batch auto chooses the gradient accumulation itself"),
    (["--micro-batch", "auto", "--strategy", "fsdp"], "strategy fsdp cannot do"),
    (["--micro-batch", "auto", "--strategy", "pipeline"], "strategy pipeline cannot do"),
    (["--micro-batch", "auto", "--parallel", "dp_shard=2"], "--parallel dp_shard=2 cannot do"),
    (["--micro-batch", "auto", "-n", "2", "--comm", "fp16"], "averages the gradients itself once every rank's micro-steps fitted, so --comm fp16"),
])
def test_bad_combinations_are_one_line_before_any_worker(argv, says, capsys):
    env = dict(os.environ)
    try:
        code = cli_main(["train", "--task", "synthetic", "--max-steps", "1", *argv])
    finally:
        os.environ.clear()
        os.environ.update(env)  # the CLI hands flags to workers through the environment
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("dtrain: error:") and says in err[0], err


def test_the_plan_proposes_smaller_micro_batches_on_smaller_devices():
    from dtrain.cli.microbatch import with_proposal
    from dtrain.train.config import TaskConfig, TrainConfig

    cfg = TrainConfig(task=TaskConfig(name="synthetic", args={"shape": "64", "hidden": "256", "samples": "512"}),
                      batch=BatchConfig(size=32, micro=AutoMicro()))
    picks = []
    for mib in (64.0, 1.02, 0.99):  # the plan's prediction for this model: ~1.0 MiB at 8 samples per micro-step
        auto = with_proposal(cfg, 2, "cpu", capacity_bytes=mib * 2**20).batch.micro
        assert auto.reserve_bytes == 4 * 85_002  # SGD's momentum, one fp32 copy of the parameters
        assert f"proposed {auto.proposal} by the plan" in auto.note
        picks.append(auto.proposal)
    assert picks[0] == 32 and all(32 % p == 0 for p in picks) and picks == sorted(picks, reverse=True), picks
    assert any(1 < p < 32 for p in picks), picks
    with pytest.raises(ConfigError, match=r"one sample per micro-step does not fit by the plan: .* MiB predicted per process"):
        with_proposal(cfg, 2, "cpu", capacity_bytes=2**19)
