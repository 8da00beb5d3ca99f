"""A replica group of several processes is watched as one (dtrain.ft.group): whole or lost."""

from __future__ import annotations

from dtrain.ft.group import GroupLink, GroupProcs
from dtrain.ft.spec import LEFT_EXIT


class _Proc:
    def __init__(self, link):
        self.link, self.exitcode, self.killed, self.terminated = link, None, False, False

    def kill(self):
        self.killed, self.exitcode = True, -9

    def terminate(self):
        self.terminated = True

    def join(self, timeout=None):
        pass


def _group(size=2):
    return GroupProcs(_Proc, size, "127.0.0.1")


def test_each_process_gets_its_rank_and_the_groups_store():
    group = _group(3)
    links = [p.link for p in group.procs]
    assert [(link.rank, link.size) for link in links] == [(0, 3), (1, 3), (2, 3)]
    assert len({link.port for link in links}) == 1 and links[0].port > 0
    env = links[1].env()
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "3", str(links[0].port))
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the store is the launcher's: every rank a client
    assert GroupLink(0, 1, "h", 1).env()["MASTER_ADDR"] == "h"


def test_a_group_runs_until_every_process_ends_and_ends_as_they_agree():
    group = _group()
    group.procs[0].exitcode = 0
    assert group.exitcode is None  # one process done, the other still running
    group.procs[1].exitcode = 0
    assert group.exitcode == 0
    left = _group()
    for proc in left.procs:
        proc.exitcode = LEFT_EXIT
    assert left.exitcode == LEFT_EXIT


def test_one_process_lost_takes_the_rest_of_its_group_down():
    group = _group(3)
    group.procs[1].exitcode = -9
    assert group.exitcode == -9
    assert group.procs[0].killed and group.procs[2].killed and not group.procs[1].killed
