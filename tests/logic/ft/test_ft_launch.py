"""The launcher's watch over its replica groups (dtrain.ft.launch._supervise), with stand-in groups:
a group that refused a user's mistake (exit status 2, its one line printed) is neither restarted
nor followed by a line of the launcher's own, and a lost group's status is its first failure."""

from __future__ import annotations

import logging

import pytest

from dtrain._log import logger
from dtrain.ft.group import GroupProcs
from dtrain.ft.launch import _supervise


class _Proc:
    def __init__(self, code):
        self.exitcode, self.killed = code, False

    def kill(self):
        self.killed, self.exitcode = True, -9

    def terminate(self):
        pass

    def join(self, timeout=None):
        pass


class _Groups:
    """Groups whose processes end at once with ``codes`` (one per process of a group)."""

    def __init__(self, codes):
        self.codes, self.size, self.spawned = codes, len(codes), []

    def spawn(self, replica_id, lighthouse, host, threads):
        self.spawned.append(replica_id)
        if self.size == 1:
            return _Proc(self.codes[0])
        return GroupProcs(lambda link: _Proc(self.codes[link.rank]), self.size, "127.0.0.1")

    def run_here(self, replica_id, lighthouse, host):
        raise AssertionError("not used")


@pytest.fixture
def said():
    """What dtrain's logger says during the test, every level."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_group_that_refused_a_mistake_is_not_restarted_and_the_launcher_adds_no_line(said):
    groups = _Groups([2])
    assert _supervise(groups, ["0-0", "0-1"], "http://127.0.0.1:1", "127.0.0.1", max_restarts=3, threads=None) == 2
    assert groups.spawned == ["0-0", "0-1"]  # once each: a restart would refuse the same input again
    assert not [s for s in said if "restart" in s or "exit status 2;" in s], said


def test_a_group_whose_process_refused_ends_with_that_status_not_the_kill_of_the_others(said):
    # rank 1 refused; rank 0, still running when the launcher looks, is killed with the group
    groups = _Groups([None, 2])
    assert _supervise(groups, ["0"], "http://127.0.0.1:1", "127.0.0.1", max_restarts=0, threads=None) == 2
    assert not [s for s in said if "SIGKILL" in s], said


def test_a_group_that_crashed_is_still_restarted_and_named(said):
    groups = _Groups([1])
    assert _supervise(groups, ["0"], "http://127.0.0.1:1", "127.0.0.1", max_restarts=1, threads=None) == 1
    assert groups.spawned == ["0", "0"]
    assert any("ended with exit status 1" in s for s in said), said
