"""The Context's face of fault tolerance without processes: what dtrain.init(fault_tolerance=...) asks
for, the launcher's hand-over to a script, and the one-line refusals (no Lighthouse, a sharding strategy,
a ledger without fault tolerance, a bad --fault-tolerance on dtrain run)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from dtrain.cli import main
from dtrain.context.replicas import requested
from dtrain.errors import ConfigError
from dtrain.ft.spec import FaultTolerance
from dtrain.options import FaultToleranceLink, Options


def test_fault_tolerance_is_on_where_the_launcher_said_so_unless_the_script_says_otherwise():
    link = FaultToleranceLink(spec="min=2,heartbeat=1", lighthouse="http://127.0.0.1:1", replica_id="a")
    assert requested(None, link) == FaultTolerance(min_replicas=2, heartbeat_s=1.0)
    assert requested(None, FaultToleranceLink()) is None and requested(False, link) is None
    assert requested(True, FaultToleranceLink()) == FaultTolerance()
    assert requested("min=3", link).min_replicas == 3
    with pytest.raises(ConfigError, match="fault_tolerance=...\\) got int 1"):
        requested(1, link)


def test_the_launcher_hands_a_group_its_settings_lighthouse_and_id_through_the_environment():
    ft = FaultTolerance(min_replicas=2, heartbeat_s=0.5, quorum_timeout_s=30)
    link = FaultToleranceLink(spec=ft.to_text(), lighthouse="http://10.0.0.1:29510", replica_id="1-0")
    env = link.to_env()
    assert env["DTRAIN_FT_LIGHTHOUSE"] == "http://10.0.0.1:29510" and env["DTRAIN_FT_REPLICA"] == "1-0"
    assert Options.from_env(env).ft == link and FaultTolerance.parse(env["DTRAIN_FT"]) == ft


def test_fault_tolerance_without_a_job_is_one_line():
    with pytest.raises(ConfigError, match="needs the job's Lighthouse and this group's id"):
        dtrain.init(fault_tolerance=True)


def test_fault_tolerance_refuses_a_sharding_strategy():
    with pytest.raises(ConfigError, match="strategy='fsdp'; leave strategy out"):
        dtrain.init(strategy="fsdp", fault_tolerance="min=1")


def test_without_fault_tolerance_every_step_commits_and_a_ledger_is_refused():
    ctx = dtrain.init()
    try:
        assert ctx.should_commit() is True
        loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
        with pytest.raises(ConfigError, match="ledger=...\\) is kept under fault tolerance only"):
            ctx.setup_dataloader(loader, ledger="ledger")
    finally:
        ctx.close()


@pytest.mark.parametrize("args, message", [
    (["--fault-tolerance", "min=0"], "--fault-tolerance min must be >= 1, got 0"),
    (["--fault-tolerance", "--lighthouse", "nohost"], "--lighthouse 'nohost' is not HOST:PORT"),
    (["--fault-tolerance", "--nnodes", "2"], "needs --master-addr"),
])
def test_bad_fault_tolerance_flags_of_dtrain_run_end_with_one_line(args, message, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", *args, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("dtrain: error:") == 1 and "Traceback" not in err


class _FakeSession:
    """torchft's part, scripted: one group alone in every quorum; ``votes`` says which steps commit."""

    def __init__(self, votes):
        self.votes, self.step, self.quorums, self.healed = list(votes), 0, 0, []

    def quorum(self, before_stop=None):
        self.quorums += 1
        return 0, 1

    def average_gradients(self, params, buffers=()):
        list(params), list(buffers)

    def should_commit(self, participants):
        ok = self.votes.pop(0)
        self.step += ok
        return ok

    def shutdown(self):
        pass


def _replicas(votes, n=10, batch=4, restart=False):
    from dtrain.context.replicas import Replicas

    rep = Replicas.__new__(Replicas)  # its torchft session replaced by the scripted one
    rep.replica_id, rep.seed, rep.device = "a", 0, torch.device("cpu")
    rep.ft, rep.restart = FaultTolerance(join_s=0.02, quorum_timeout_s=0.1), restart
    rep.models, rep.optimizers, rep.order, rep.batch, rep.ledger, rep.pending, rep.plan = [torch.nn.Linear(1, 1)], [], None, 1, None, None, None
    rep.session = _FakeSession(votes)
    return rep, rep.loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch), ledger=None, move_to_device=False)


def test_a_step_not_committed_is_trained_again_and_a_pass_is_the_rest_of_an_epoch():
    rep, loader = _replicas([True, False, True, True, True])
    seen = []
    for (x,) in loader:  # 10 samples, 4 a step: 2 steps an epoch, 2 left out
        seen.append(x.tolist())
        rep.should_commit()
    assert seen[1] == seen[2] and len(seen) == 3  # the step not committed: the same samples again
    assert loader.next_epoch == 1 and rep.pending is not None  # the next pass begins from the quorum already taken
    quorums = rep.session.quorums
    second = [x.tolist() for (x,) in _committing(loader, rep)]
    assert len(second) == 2 and rep.session.quorums == quorums + 2  # the pending quorum is the first step's
    assert sorted(sum(seen[0:1] + seen[2:], [])) != sorted(sum(second, []))  # epoch 1's own order


def _committing(loader, rep):
    for batch in loader:
        yield batch
        rep.should_commit()


def test_the_next_batch_without_should_commit_is_one_line():
    rep, loader = _replicas([True])
    batches = iter(loader)
    next(batches)
    with pytest.raises(ConfigError, match="every step ends with ctx.should_commit"):
        next(batches)
    rep.plan = None
    with pytest.raises(ConfigError, match="ctx.should_commit\\(\\) ends a step"):
        rep.should_commit()


def test_an_accumulation_window_is_one_step_one_quorum_and_one_vote():
    """ctx.accumulate(model, steps=3) under fault tolerance: 3 batches a step, one quorum and one vote
    each; a window not committed is trained again whole; the epoch's end cuts the last window short."""
    votes = [True, False, True, True, True]
    rep, _ = _replicas([], n=40, batch=4)
    rep.order = None  # set up again, through the Context's own calls
    rep.session = session = _FakeSession(votes)
    session.shutdown = lambda: None
    ctx = dtrain.init()
    ctx._replicas = rep
    model = torch.nn.Linear(1, 1)
    try:
        loader = ctx.setup_dataloader(DataLoader(TensorDataset(torch.arange(40)), batch_size=4), move_to_device=False)
        windows, window, answers = [], [], []
        for (x,) in loader:
            with ctx.accumulate(model, steps=3):
                ctx.backward(model(x.float()[:, None]).sum())
            window.append(x.tolist())
            answers.append(ctx.should_commit())
            if ctx.sync_gradients:
                windows.append(window)
                window = []
    finally:
        ctx.close()
    assert [len(w) for w in windows] == [3, 3, 3, 3, 1]  # 10 batches an epoch: 3 + 3 + 3 + the rest
    assert session.quorums == 6 and session.votes == []  # a quorum and a vote per window (+ the next epoch's quorum)
    assert answers == [False, False, True, False, False, False, False, False, True, False, False, True, True]
    assert windows[1] == windows[2]  # the window not committed: its samples again, under the next quorum
    committed = sorted(i for w in windows[:1] + windows[2:] for b in w for i in b)
    assert committed == list(range(40)) and rep.order.epoch == 0 and rep.order.pos == 40  # each sample once


def test_a_stop_signal_leaves_after_the_window_in_flight_and_close_exits_143(tmp_path):
    """SIGTERM mid-window: the window finishes and votes, no further quorum is taken, the ledger gets no
    end record (the job goes on), and ctx.close() exits with LEFT_EXIT so the launcher does not restart it."""
    import signal

    from dtrain.context import preempt
    from dtrain.ft.spec import LEFT_EXIT

    rep, _ = _replicas([], n=40, batch=4)
    rep.order, rep.ledger = None, None
    rep.session = session = _FakeSession([True] * 10)
    session.shutdown = lambda: None
    ctx = dtrain.init()
    ctx._replicas = rep
    model = torch.nn.Linear(1, 1)
    preempt.install()
    try:
        loader = ctx.setup_dataloader(DataLoader(TensorDataset(torch.arange(40)), batch_size=4), move_to_device=False,
                                      ledger=str(tmp_path / "ledger"))
        seen = []
        for _ in range(3):  # the user's epochs: after the leave, every pass is empty
            for (x,) in loader:
                seen.append(x.tolist())
                if len(seen) == 3:
                    signal.raise_signal(signal.SIGTERM)  # in the second window's first batch
                with ctx.accumulate(model, steps=2):
                    ctx.backward(model(x.float()[:, None]).sum())
                ctx.should_commit()
        with pytest.raises(SystemExit) as left:
            ctx.close()
    finally:
        preempt.uninstall()
    assert left.value.code == LEFT_EXIT and rep.left == signal.SIGTERM
    assert len(seen) == 4 and session.quorums == 2 and rep.order.pos == 16  # 2 windows committed, no third quorum
    records = [line for f in (tmp_path / "ledger").iterdir() for line in f.read_text().splitlines()]
    assert len(records) == 3 and not any('"end"' in r for r in records)  # a header, 2 steps, no end


def test_a_step_into_the_next_epoch_not_committed_keeps_the_passes_on_the_datas_epochs():
    """12 samples, 4 a group: with 2 groups the epoch's rest (4) does not fill a step, so the next pass
    begins epoch 1; that step is not committed, and alone the next quorum fits the rest of epoch 0. The
    pass trains it and goes on with epoch 1: one pass per epoch of the data (a group that heals counts so)."""
    rep, loader = _replicas([True, False, True, True, True, True, True], n=12, batch=4)
    sizes = iter([2, 1, 1, 1, 1, 1, 1])  # participants of each quorum after the first
    rep.session.quorum = lambda before_stop=None: (0, next(sizes))
    rep.pending = (0, 2)
    first = [x.tolist() for (x,) in _committing(loader, rep)]
    second = [x.tolist() for (x,) in _committing(loader, rep)]
    assert len(first) == 1 and len(second) == 5  # epoch 1's step (not committed), epoch 0's rest, epoch 1's 3 steps
    assert rep.order.epoch == 1 and rep.order.pos == 12 and loader.next_epoch == 2


def test_a_restarted_group_alone_at_step_0_stops_with_one_line_instead_of_training_the_job_again():
    from dtrain.ft.spec import FaultToleranceStopped

    with pytest.raises(FaultToleranceStopped, match=r"replica group a: restarted, but alone in its quorum for 0.1 s at step 0"):
        _replicas([True], restart=True)
    rep, _ = _replicas([True])  # started the first time: alone is how a job with min=1 begins
    assert rep.session.quorums == 1
