"""dtrain.ft without processes: the --fault-tolerance spec, the global order's rule (a step not
committed consumes nothing; the global batch follows the quorum), and the ledger's check."""

from __future__ import annotations

import json
import types

import pytest
import torch

from dtrain.cli import main
from dtrain.errors import ConfigError
from dtrain.ft.ledger import FtLedger, check_ft_ledger
from dtrain.ft.order import GlobalOrder, StepPlan
from dtrain.ft.spec import FaultTolerance, lighthouse_address
from dtrain.train.config import BatchConfig
from dtrain.train.ft_replica import _Replica


def test_the_spec_reads_min_and_the_timeouts():
    assert FaultTolerance.parse("") == FaultTolerance()
    ft = FaultTolerance.parse("min=2,heartbeat=0.5,timeout=10")
    assert (ft.min_replicas, ft.heartbeat_s, ft.quorum_timeout_s) == (2, 0.5, 10.0)


@pytest.mark.parametrize("text, message", [
    ("min=0", "min must be >= 1, got 0"),
    ("min=two", "min='two' is not a whole number"),
    ("size=2", "'size=2' is not one of min=..."),
    ("heartbeat=-1", "heartbeat must be > 0 seconds, got -1.0"),
])
def test_a_bad_spec_is_one_line(text, message):
    with pytest.raises(ConfigError, match=message):
        FaultTolerance.parse(text)


def test_the_lighthouse_address_is_host_and_port():
    assert lighthouse_address("127.0.0.1:29510") == "http://127.0.0.1:29510"
    assert lighthouse_address("http://localhost:1") == "http://localhost:1"
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        lighthouse_address("127.0.0.1")


def _run(order, plans):
    """Steps as (participants, committed); returns every committed step's samples."""
    done = []
    for participants, committed in plans:
        steps = [order.plan(r, participants, 4) for r in range(participants)]
        assert [i for p in steps for i in p.mine] == steps[0].step_indices  # the slices tile the step
        if committed:
            order.commit(steps[0])
            done.append(steps[0])
    return done


def test_a_step_not_committed_consumes_no_samples_and_the_batch_follows_the_quorum():
    order = GlobalOrder(40, seed=3, epochs=1)
    done = _run(order, [(2, True), (2, False), (1, True), (1, False), (3, True), (2, True)])
    assert [len(p.step_indices) for p in done] == [8, 4, 12, 8]  # participants x batch
    seen = [i for p in done for i in p.step_indices]
    assert len(seen) == len(set(seen)) == 32 and order.pos == 32
    last = order.plan(0, 3, 4)  # 8 left, fewer than 3 x 4: the epoch ends, the job is done
    assert last.done and sorted(last.dropped[1] + seen) == list(range(40))
    assert not order.plan(0, 2, 4).done  # with 2 participants the rest fills a step


def test_every_replica_group_plans_the_same_order_from_the_same_state():
    a, b = GlobalOrder(100, seed=1, epochs=2), GlobalOrder(100, seed=1, epochs=2)
    _run(a, [(2, True)] * 7)
    b.load_state_dict(a.state_dict())  # what a returning group heals from
    assert a.plan(1, 2, 4) == b.plan(1, 2, 4)
    nxt = a.plan(0, 2, 4)  # 100 - 56 = 44 left: still epoch 0
    assert nxt.epoch == 0 and GlobalOrder(100, seed=2, epochs=1).order(0) != a.order(0)


def _ledger(folder, replica, steps, order, *, healed=False):
    led = FtLedger(str(folder), replica, order.n)
    led.begin(0, healed=healed)
    for _ in range(steps):
        plan = order.plan(0, 2, 4)
        order.commit(plan)
        led.commit(order.pos // 8, plan)
    led.close()
    return led.path


def test_the_ledger_counts_a_step_both_groups_wrote_once(tmp_path):
    _ledger(tmp_path, "a", 5, GlobalOrder(40, seed=0, epochs=1))
    # b joined at step 0 (the initial sync) and was killed after its 5th commit, before its 5th line
    _ledger(tmp_path, "b", 4, GlobalOrder(40, seed=0, epochs=1), healed=True)
    report, disagree = check_ft_ledger(str(tmp_path))
    assert report.ok and disagree == [] and report.steps_kept == 5
    assert report.epochs[0].seen == 40 and report.epochs[0].duplicated == 0


def test_the_ledger_fails_records_of_one_step_that_disagree(tmp_path):
    _ledger(tmp_path, "a", 3, GlobalOrder(40, seed=0, epochs=1))
    _ledger(tmp_path, "b", 3, GlobalOrder(40, seed=1, epochs=1), healed=True)  # another order: a bug the check must catch
    _, disagree = check_ft_ledger(str(tmp_path))
    assert disagree == [1, 2, 3]


def test_a_restart_from_disk_drops_the_steps_it_redoes(tmp_path):
    path = _ledger(tmp_path, "a", 4, GlobalOrder(40, seed=0, epochs=1))
    order = GlobalOrder(40, seed=0, epochs=1)
    _run(order, [(2, True)] * 2)  # resumed from a checkpoint of step 2, then took steps 3, 4 with one group
    led = FtLedger(str(tmp_path), "a", 40)
    led.begin(2, healed=False)
    for step in (3, 4):
        plan = order.plan(0, 1, 4)
        order.commit(plan)
        led.commit(step, plan)
    led.close()
    report, disagree = check_ft_ledger(str(tmp_path))
    assert disagree == [] and report.steps_kept == 4 and report.steps_discarded == 0
    assert report.epochs[0].seen == 24 and report.epochs[0].duplicated == 0
    with open(path) as f:
        assert sum("s" in json.loads(line) for line in f) == 4  # the old lines stay; the check leaves them out


@pytest.mark.parametrize("args, message", [
    (["--fault-tolerance", "min=0"], "--fault-tolerance min must be >= 1, got 0"),
    (["--fault-tolerance", "--strategy", "hsdp"], "other --strategy values and --parallel auto inside a replica group are not"),
    (["--fault-tolerance", "--strategy", "pipeline"], "use --strategy fsdp, or --parallel tp=N / pp=N"),
    (["--fault-tolerance", "--parallel", "auto"], "use --strategy fsdp, or --parallel tp=N / pp=N"),
    (["--fault-tolerance", "--parallel", "tp=2"], "--parallel tp=2: tp=2 = 2 processes, but the job has 1"),  # one group's --nproc
    (["--fault-tolerance", "--nnodes", "1:2"], "replica groups come and go without a rendezvous"),
    (["--fault-tolerance", "--lighthouse", "nohost"], "--lighthouse 'nohost' is not HOST:PORT"),
    (["--fault-tolerance", "--elastic-batch", "global"], "--elastic-batch global and --micro-batch auto are not supported"),
    (["--fault-tolerance", "--micro-batch", "auto"], "--elastic-batch global and --micro-batch auto are not supported"),
])
def test_bad_fault_tolerance_flags_end_with_one_line(args, message, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("dtrain: error:") == 1 and "Traceback" not in err


def test_dtrain_ckpt_ledger_reads_a_fault_tolerant_ledger(tmp_path, capsys):
    _ledger(tmp_path, "a", 5, GlobalOrder(40, seed=0, epochs=1))
    assert main(["ckpt", "ledger", str(tmp_path)]) == 0
    assert "exactly once" in capsys.readouterr().out
    _ledger(tmp_path, "b", 3, GlobalOrder(40, seed=1, epochs=1), healed=True)  # records that disagree
    assert main(["ckpt", "ledger", str(tmp_path)]) == 1
    assert "FAIL: step 1's records disagree" in capsys.readouterr().out


def _share_gradients(grad_accum):
    """``dtrain train --fault-tolerance``'s step on one group's share (its all-reduce a no-op here):
    the gradients, and how many forwards it took."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    rep = _Replica.__new__(_Replica)
    plain = types.SimpleNamespace(capabilities=types.SimpleNamespace(staged_step=False))  # no pipeline
    rep.ctx = types.SimpleNamespace(device=torch.device("cpu"), strategy=plain)
    rep.cfg = types.SimpleNamespace(batch=BatchConfig(size=8, grad_accum=grad_accum), parallel=types.SimpleNamespace(layout=None))
    rep.task = types.SimpleNamespace(train_set=data, loss_fn=torch.nn.functional.cross_entropy)
    rep.model = torch.nn.Linear(3, 2)
    rep.rank, rep.dp_rank, rep.batch = 0, 0, 8  # a group of one process
    rep.session = types.SimpleNamespace(average_gradients=lambda params, buffers=(): None)
    forwards = []
    rep.model.register_forward_hook(lambda *_: forwards.append(1))
    loss = rep._forward_backward(StepPlan(epoch=0, start=0, step_indices=list(range(8)), mine=list(range(8))))
    return [p.grad.clone() for p in rep.model.parameters()], loss, len(forwards)


def test_grad_accum_under_fault_tolerance_takes_k_micro_batches_with_the_whole_share_gradient():
    whole, loss1, n1 = _share_gradients(1)
    accum, loss2, n2 = _share_gradients(4)
    assert (n1, n2) == (1, 4)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, accum)) and torch.allclose(loss1, loss2, atol=1e-6)
