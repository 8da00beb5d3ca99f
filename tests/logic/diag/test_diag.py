"""Diagnostics: the stall watchdog, the collective checker, pre-launch checks and dtrain doctor."""

from __future__ import annotations

import sys

import pytest
import torch

from dtrain import LaunchError
from dtrain.diag.watchdog import merge_report
from dtrain.launch.preflight import _compare


def test_tracker_records_collectives_and_arms_on_first_progress():
    from dtrain.diag import Tracker

    tr = Tracker(history=2)
    assert not tr.armed  # setting up: no stall can be declared yet
    call = tr.enter("all_reduce(sum)", torch.zeros(3, 2), [torch.ones(1, dtype=torch.int64)])
    line = sys._getframe().f_lineno - 1
    assert tr.armed and tr.current is call
    assert call.describe() == f"all_reduce(sum) #1 float32[3, 2], [int64[1]] at test_diag.py:{line}"
    tr.leave(call)
    for _ in range(3):
        tr.leave(tr.enter("barrier"))
    assert tr.current is None and [c.seq for c in tr.recent] == [3, 4]  # a ring buffer
    snap = tr.snapshot(0)
    assert snap["last_done_seq"] == 4 and snap["current"] is None and snap["at"].startswith("test_diag.py:")


def test_merge_report_names_the_lagging_rank():
    snaps = {
        0: {"rank": 0, "step": 7, "at": "t.py:30", "innermost": "x", "in_backward": False, "current": "all_reduce #9 float32[1] at t.py:30",
            "current_seq": 9, "last_done_seq": 8, "dump": "/r/stall-rank0.txt"},
        1: {"rank": 1, "step": 6, "at": "t.py:88", "innermost": "y", "in_backward": False, "current": None,
            "current_seq": None, "last_done_seq": 8, "dump": "/r/stall-rank1.txt"},
        2: {"rank": 2, "step": 7, "at": "t.py:30", "innermost": "x", "in_backward": False, "current": "all_reduce #9 float32[1] at t.py:30",
            "current_seq": 9, "last_done_seq": 8, "dump": "/r/stall-rank2.txt"},
    }
    report = merge_report(snaps, 4, 10)
    assert "rank 1 at t.py:88 (step 6, no collective since #8" in report
    assert "ranks 0,2 waiting in all_reduce #9" in report
    assert "rank 3 did not answer" in report
    snaps[2].update(current=None, current_seq=None, in_backward=True, at="t.py:25")  # in a plain loss.backward()
    report = merge_report(snaps, 4, 10)
    assert "rank 1 at t.py:88" in report and "rank 2 waiting in backward (gradient all-reduce) at t.py:25" in report


def test_nodes_with_different_versions_or_sizes_are_named():
    a = {"nnodes": 2, "nproc": 2, "dtrain": "0.1.0", "torch": "2.13.0", "python": "3.11.7", "host": "a"}
    with pytest.raises(LaunchError, match=r"different torch versions: node 0 \(a\) has 2.13.0, node 1 \(b\) has 2.12.1"):
        _compare(a, 0, {**a, "torch": "2.12.1", "host": "b"}, 1)
    with pytest.raises(LaunchError, match=r"--nnodes 2 -n 2 \(world size 4\).*--nnodes 3 -n 2 \(world size 6\)"):
        _compare(a, 0, {**a, "nnodes": 3, "host": "b"}, 1)
