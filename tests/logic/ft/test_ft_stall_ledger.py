"""The ledger's check reads the job's surviving line of commits: a step committed by one side only
(torchft's vote counts a group's own processes) by a group that then died is lost like an
uncommitted step, and the survivor's later commit of it stands; two groups that both went on from
different commits of one step still disagree (dtrain.ft.ledger's docstring)."""

from __future__ import annotations

import itertools

import pytest

from dtrain.ft import ledger as ft_ledger
from dtrain.ft.ledger import FtLedger, check_ft_ledger
from dtrain.ft.order import GlobalOrder


@pytest.fixture
def clock(monkeypatch):
    """The ledger's ``t`` in the order the lines are written (a real clock may repeat a value)."""
    ticks = itertools.count(1000.0)
    monkeypatch.setattr(ft_ledger.time, "time", lambda: next(ticks))


def _commit(led, order, step, participants):
    plan = order.plan(0, participants, 4)
    order.commit(plan)
    led.commit(step, plan)


def _one_sided_then(tmp_path, *, a_goes_on=False, a_resumes_at=None):
    """a and b commit steps 1-3 together; a commits step 4 alone (b's vote failed); then a stops
    (killed), or goes on (``a_goes_on``); b commits step 4 again, alone, and steps 5-6."""
    a, b = GlobalOrder(40, seed=0, epochs=1), GlobalOrder(40, seed=0, epochs=1)
    la, lb = FtLedger(str(tmp_path), "a", 40), FtLedger(str(tmp_path), "b", 40)
    la.begin(0, healed=False)
    lb.begin(0, healed=True)
    for step in (1, 2, 3):
        _commit(la, a, step, 2)
        _commit(lb, b, step, 2)
    _commit(la, a, 4, 2)  # one side only: a's all-reduce completed, b's did not
    for step in (4, 5, 6):
        _commit(lb, b, step, 1)
    if a_goes_on:
        _commit(la, a, 5, 2)
    la.close()
    if a_resumes_at is not None:  # a restarted from its own checkpoint of that step
        again = FtLedger(str(tmp_path), "a", 40)
        again.begin(a_resumes_at, healed=False)
        again.close()
    lb.close()


def test_a_one_sided_commit_lost_with_its_group_is_not_the_jobs_line(tmp_path, clock):
    _one_sided_then(tmp_path)
    report, disagree = check_ft_ledger(str(tmp_path))
    assert disagree == [] and report.ok and report.steps_kept == 6
    # b's own step 4 stands: 3 steps of 8 samples, then 3 of 4, each once
    assert report.epochs[0].seen == 36 and report.epochs[0].duplicated == 0


def test_two_groups_that_went_on_from_different_commits_of_one_step_disagree(tmp_path, clock):
    _one_sided_then(tmp_path, a_goes_on=True)
    assert check_ft_ledger(str(tmp_path))[1] == [4, 5]


def test_a_one_sided_commit_its_group_resumed_from_disk_still_disagrees(tmp_path, clock):
    _one_sided_then(tmp_path, a_resumes_at=4)  # a's line went on from its checkpoint of step 4
    assert 4 in check_ft_ledger(str(tmp_path))[1]
