"""The slowness driver (tests/support/slowdown.py), a ``dtrain train`` plugin: the rank it names
sleeps before each batch is handed over or in each forward of the model ``ctx.setup`` returned,
or runs a hog thread; every hook is undone at the loop's end; a malformed value is one line."""

from __future__ import annotations

import types

import pytest
import torch

from dtrain.context.step import DtrainModule
from dtrain.errors import ConfigError
from dtrain.metrics.breakdown import StepBreakdown
from dtrain.precision import Precision
from dtrain.train.listeners import LoopState
from tests.support import run_cli_here, slowdown


def _ctx(rank: int = 1):
    return types.SimpleNamespace(rank=rank, breakdown=StepBreakdown())


@pytest.fixture
def sleeps(monkeypatch):
    said: list[float] = []
    monkeypatch.setattr(slowdown.time, "sleep", said.append)
    return said


def test_only_the_named_rank_is_slowed(monkeypatch):
    monkeypatch.setenv(slowdown.VAR, "1:input:40")
    assert slowdown.listeners(_ctx(0)) == []
    [slow] = slowdown.listeners(_ctx(1))
    assert (slow.kind, slow.seconds) == ("input", 0.04)


def test_input_sleeps_before_each_batch_is_marked_until_the_loop_ends(sleeps):
    ctx, state = _ctx(), LoopState(step=0, total=1)
    slow = slowdown.SlowDown(ctx, "input", 40)
    slow.on_start(state)
    ctx.breakdown.got_batch()
    slow.on_end(state)
    ctx.breakdown.got_batch()
    assert sleeps == [0.04]


def test_compute_sleeps_in_each_forward_of_the_set_up_model_only(sleeps):
    inner = torch.nn.Linear(2, 2)
    model = DtrainModule(inner, inner, Precision.resolve("fp32", torch.device("cpu")))
    state = LoopState(step=0, total=1)
    slow = slowdown.SlowDown(_ctx(), "compute", 20)
    slow.on_start(state)
    model(torch.zeros(1, 2))
    slow.on_end(state)
    model(torch.zeros(1, 2))
    assert sleeps == [0.02]  # once per forward (not per submodule), none after the end


def test_hog_runs_a_thread_until_the_loop_ends():
    slow, state = slowdown.SlowDown(_ctx(), "hog", 0), LoopState(step=0, total=1)
    slow.on_start(state)
    slow.on_end(state)
    assert slow._stop.is_set() and slow._undo == []


@pytest.mark.parametrize("text, says", [("1:sleepy", "kind 'sleepy' is unknown"), ("x:input", "is not RANK:KIND[:MS]")])
def test_a_malformed_value_is_one_line(text, says, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        slowdown.parse(text)
    monkeypatch.setenv("DTRAIN_PLUGIN", "tests.support.slowdown")
    monkeypatch.setenv(slowdown.VAR, text)
    assert run_cli_here(["train", "--max-steps", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("dtrain: error: DTRAIN_SLOW_INJECT") and says in lines[-1]
