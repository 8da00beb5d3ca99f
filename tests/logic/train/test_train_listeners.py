"""The training loop's listeners, each alone with stand-ins for the context and the objects it
drives (tier 1: no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain import preempt
from dtrain.errors import ConfigError
from dtrain.train.listeners import Listener, Listeners, LoopState
from dtrain.train.listeners.checkpoints import Checkpoints
from dtrain.train.listeners.divergence import Diverged, DivergenceCheck
from dtrain.train.listeners.ledger import LedgerListener
from dtrain.train.listeners.plugin import plugin_listeners
from dtrain.train.listeners.preemption import Preemption
from dtrain.train.listeners.report import LossWindow, Report
from tests.support import faults


class OneRank:
    """A context of one process: all_reduce returns the tensor (mean and max of one value)."""

    is_main = True

    def __init__(self) -> None:
        self.reduced: list[tuple[float, str]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        self.reduced.append((float(tensor), op))
        return tensor


def state(step: int = 1, total: int = 10, **kw) -> LoopState:
    return LoopState(step=step, total=total, window_loss=torch.zeros(()), **kw)


def test_listeners_hear_every_hook_in_their_order():
    heard = []

    class Say(Listener):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_start(self, s: LoopState) -> None:
            heard.append(("start", self.name))

        def on_step(self, s: LoopState) -> None:
            heard.append(("step", self.name))

        def on_end(self, s: LoopState) -> None:
            heard.append(("end", self.name))

    both = Listeners([Say("a"), Say("b")])
    s = state()
    both.on_start(s), both.on_step(s), both.on_end(s)
    assert heard == [("start", "a"), ("start", "b"), ("step", "a"), ("step", "b"), ("end", "a"), ("end", "b")]
    Listener().on_step(s)  # the defaults do nothing


def test_ledger_begins_at_the_resumed_step_and_commits_each_step():
    calls = []

    class Ledger:
        def begin(self, step: int) -> None:
            calls.append(("begin", step))

        def commit(self, step: int) -> None:
            calls.append(("commit", step))

    listener, s = LedgerListener(Ledger()), state(step=4)
    listener.on_start(s)
    for step in (5, 6):
        s.step = step
        listener.on_step(s)
    assert calls == [("begin", 4), ("commit", 5), ("commit", 6)]


def test_fault_injection_kills_its_rank_after_its_step_on_the_first_attempt_only():
    assert faults.fault_step((1, 25), rank=1, restarts=0) == 25
    assert faults.fault_step((1, 25), rank=0, restarts=0) is None
    assert faults.fault_step((1, 25), rank=1, restarts=1) is None
    assert faults.fault_step(None, rank=0, restarts=0) is None
    killed = []
    listener = faults.FaultInjection(3, kill=lambda: killed.append(True))
    for step in (2, 3, 4):
        listener.on_step(state(step=step))
    assert killed == [True]
    with pytest.raises(ConfigError, match=r"DTRAIN_FAULT_INJECT='x' is not RANK:STEP"):
        faults.parse("x")


class _Rank:
    def __init__(self, rank, restarts=0):
        self.rank, self.world = rank, type("W", (), {"restart_count": restarts})()


def test_the_plugin_named_by_dtrain_plugin_adds_its_listeners_to_the_loop(monkeypatch):
    # the tests' fault driver is such a plugin: the product holds only the hook
    monkeypatch.setenv("DTRAIN_FAULT_INJECT", "1:25")
    assert plugin_listeners(None, _Rank(1)) == []
    [added] = plugin_listeners("tests.support.faults", _Rank(1))
    assert isinstance(added, faults.FaultInjection) and added.step == 25
    assert plugin_listeners("tests.support.faults", _Rank(0)) == []
    with pytest.raises(ConfigError, match=r"DTRAIN_PLUGIN='no_such_module_x' cannot be imported"):
        plugin_listeners("no_such_module_x", _Rank(0))
    with pytest.raises(ConfigError, match=r"DTRAIN_PLUGIN='math' has no listeners\(ctx\) function"):
        plugin_listeners("math", _Rank(0))


def test_loss_window_logs_the_mean_every_interval_and_at_the_last_step():
    ctx, window = OneRank(), LossWindow(OneRank(), log_every=2)
    window.ctx = ctx
    s = state(step=1, total=3)
    s.window_loss += 3.0
    s.window_steps = 1
    window.on_step(s)
    assert not s.logged and s.window_steps == 1 and math.isnan(s.last_loss)
    s.step, s.window_steps = 2, 2
    s.window_loss += 1.0
    window.on_step(s)
    assert s.logged and s.last_loss == 2.0 and s.window_steps == 0 and float(s.window_loss) == 0.0
    assert ctx.reduced == [(2.0, "mean")]
    s.step, s.window_steps = 3, 1
    s.window_loss += 5.0
    window.on_step(s)
    assert s.logged and s.last_loss == 5.0  # the last step logs, off the interval too


def test_divergence_stops_at_a_logged_nan_and_before_a_save_between_logs():
    ctx = OneRank()
    check = DivergenceCheck(ctx, lr=0.5, checkpoint_dir="ck", save_due=lambda s: s.step == 3)
    check.on_step(state(step=2, logged=True, last_loss=1.5))  # finite: nothing
    with pytest.raises(Diverged, match=r"became nan at step 2 \(lr 0.5\); nothing saved after it, ck keeps the last good"):
        check.on_step(state(step=2, logged=True, last_loss=math.nan))
    s = state(step=3)
    s.window_loss += math.inf
    s.window_steps = 1
    with pytest.raises(Diverged, match="became inf at step 3"):
        check.on_step(s)
    assert ctx.reduced == [(math.inf, "max")]  # the largest loss of any rank
    s.step = 4  # no save due: no collective, no check
    check.on_step(s)
    assert len(ctx.reduced) == 1


def test_report_writes_each_logged_interval_and_ticks_every_step():
    class Obs:
        def __init__(self) -> None:
            self.ticks, self.written, self.closed = [], [], False

        def interval(self, step: int, sps: float | None) -> dict:
            return {"breakdown": step}

        def tick(self, step: int) -> None:
            self.ticks.append(step)

        def write(self, record: dict) -> None:
            self.written.append(record)

        def close(self) -> None:
            self.closed = True

    class Wait:
        def window_median_ms(self) -> float:
            return 1.0

    class Sink:
        def __init__(self) -> None:
            self.records = []

        def write(self, record: dict) -> None:
            self.records.append(record)

    obs, sink = Obs(), Sink()
    report = Report(observer=obs, wait=Wait(), t0=0.0, rate=lambda steps: 10.0 * steps, extra=lambda sps: {"tokens_per_s": sps},
                    sink=sink)
    report.on_step(state(step=1, start_step=0))
    report.on_step(state(step=2, start_step=0, logged=True, last_loss=0.5, epoch=1))
    assert obs.ticks == [1, 2] and len(sink.records) == 1 and obs.written == sink.records
    record = sink.records[0]
    assert (record["step"], record["epoch"], record["train_loss"], record["samples_per_s"]) == (2, 1, 0.5, 20.0)
    assert (record["tokens_per_s"], record["breakdown"], record["data_wait_ms"]) == (20.0, 2, 1.0)
    report.on_end(state())
    assert obs.closed


def test_preemption_checks_at_log_steps_before_the_last_and_saves_through_its_hook(monkeypatch):
    checked, saved = [], []
    monkeypatch.setattr(preempt, "check", lambda ctx, announce=True: checked.append(announce) or True)
    monkeypatch.setattr(preempt, "received", lambda: 15)
    hooks = []
    monkeypatch.setattr(preempt, "register", lambda fn: hooks.append(fn) or fn)
    monkeypatch.setattr(preempt, "uninstall", lambda: None)
    listener = Preemption(OneRank(), log_every=2, elastic=False, save=saved.append)
    s = state(step=1, total=4)
    listener.on_start(s)
    listener.on_step(s)
    assert checked == [] and not s.stop  # not a log step
    s.step = 4
    listener.on_step(s)
    assert checked == [] and not s.stop  # the last step: the run ends anyway
    s.step = 2
    listener.on_step(s)
    assert checked == [True] and s.stop and listener.signalled_here
    hooks[0]()  # the signal's hook saves the step reached when it runs
    assert saved == [2]


def test_preemption_without_checkpoints_says_a_requeued_job_starts_again(monkeypatch, caplog):
    monkeypatch.setattr(preempt, "uninstall", lambda: None)
    s = state(stop=True)
    with caplog.at_level("WARNING", logger="dtrain"):
        Preemption(OneRank(), log_every=2, elastic=False).on_end(s)
    assert "no --checkpoint-dir, so a requeued job starts again from step 0" in caplog.text


def test_checkpoints_save_every_n_steps_and_at_the_end_unless_preempted():
    class Manager:
        last_blocking_s = 0.25

        def __init__(self) -> None:
            self.saved, self.waited = [], 0

        def save(self, step: int, **objects) -> None:
            self.saved.append((step, sorted(objects)))

        def wait(self) -> None:
            self.waited += 1

    manager = Manager()
    saves = Checkpoints(manager, save_every=2, objects={"model": 1, "optimizer": 2})
    for step in range(1, 5):
        saves.on_step(state(step=step, total=4))
    assert manager.saved == [(2, ["model", "optimizer"])]  # step 4 is the last: saved at the end
    saves.on_end(state(step=4, total=4))
    assert [s for s, _ in manager.saved] == [2, 4] and manager.waited == 1 and saves.blocked_s == 0.5
    preempted = Checkpoints(Manager(), save_every=None, objects={})
    assert not preempted.due(state(step=2))
    preempted.on_end(state(step=3, stop=True))  # saved by the signal's hook already
    assert preempted.manager.saved == [] and preempted.manager.waited == 1
