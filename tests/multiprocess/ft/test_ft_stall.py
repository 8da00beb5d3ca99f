"""A replica group that dies after the Lighthouse put it in a quorum, before it reached the quorum's
store (a host killed at start-up right after it asked for a quorum), holds the survivors' next step
for the Lighthouse's time to take it for dead (``FaultTolerance.connect_s``), not for the whole
``step-timeout``; each collective still has ``step-timeout``; a group whose step failed closes its
process group before its vote, so a peer waiting on it in the all-reduce fails at once too
(``dtrain.ft.process_group``)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import pytest
import torch

from tests.multiprocess.ft.test_fault_tolerance import _lighthouse, _mkdir, _records, _result
from tests.multiprocess.ft.test_ft_stall_one_sided import ONE_SIDED, lighthouse  # noqa: F401 (a fixture)
from tests.paths import TESTS
from tests.support import run_distributed
from tests.support.procs import LaunchedJob

pytest.importorskip("torchft")

DIES = str(TESTS / "scripts" / "ft_dies_in_quorum.py")


def _configure_then_allreduce(connect_s, late_s):
    from torch.distributed import AllreduceOptions, ReduceOp

    from dtrain.ft.process_group import QuorumGroup

    rank, store = int(os.environ["RANK"]), f"127.0.0.1:{os.environ['MASTER_PORT']}"
    group = QuorumGroup(connect=timedelta(seconds=connect_s), step=timedelta(seconds=120))
    try:
        group.configure(f"{store}/q1", "r", rank, 3)  # a third member that never comes: given up after connect_s
        missing_member = None
    except Exception as exc:
        missing_member = str(exc).splitlines()[0]
    group.configure(f"{store}/q2", "r", rank, 2)  # the next quorum, without it
    if rank == 1:
        time.sleep(late_s)  # a step slower than the start's bound: the collective must still wait for it
    t = torch.full((4,), float(rank + 1))
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    group.allreduce([t], opts).wait()
    group.abort(errored=False)
    return missing_member, t.tolist()


@pytest.mark.timeout(120)
def test_the_start_is_bounded_apart_from_the_collectives():
    results = run_distributed(_configure_then_allreduce, 2.0, 6.0, world_size=2, timeout=100)
    for missing_member, total in results:
        assert missing_member is not None and "timeout" in missing_member.lower(), missing_member
        assert total == [3.0] * 4  # one timeout for both (torchft's own group) fails this all-reduce after 2 s


@pytest.mark.timeout(180)
def test_a_group_dead_in_its_first_quorum_holds_the_survivor_for_the_heartbeat_not_the_step_timeout(tmp_path):
    (tmp_path / "pace").write_text("0.002")
    metrics = str(tmp_path / "metrics.jsonl")
    # step-timeout=600: a survivor that waited it out would outlast this test's timeout many times over
    spec = "min=1,heartbeat=1,timeout=60,step-timeout=600"

    def args(replica, *extra):
        return ["train", "--fault-tolerance", spec, "--task", "tests.user_task:make_paced", "--task-arg",
                f"pace_file={tmp_path / 'pace'}", "--epochs", "1000", "--replica-id", replica,
                "--metrics-file", metrics, "--log-every", "1", *extra]

    with LaunchedJob(args("a"), out_dir=_mkdir(tmp_path / "a")) as a:
        a.wait_for(lambda: sum(r["replica"] == "a" for r in _records(metrics)) >= 3, timeout=120)
        with LaunchedJob(args("c", "--lighthouse", _lighthouse(a)), out_dir=_mkdir(tmp_path / "c"),
                         prefix=[sys.executable, DIES]) as c:
            assert c.wait(timeout=120)[0] == -9, c.stderr()
            died = time.time()
            assert "in a quorum" in c.stderr(), c.stderr()
        # a's step with c in its quorum was given up (c never reached the store), then a went on alone
        a.wait_for(lambda: sum(r["replica"] == "a" and r["time"] > died for r in _records(metrics)) >= 3, timeout=60)
        given_up = [line for line in a.stderr().splitlines() if "not committed" in line]
    assert given_up and all("timeout" in line for line in given_up), given_up
    after = [r for r in _records(metrics) if r["replica"] == "a" and r["time"] > died]
    assert all(r["participants"] == 1 for r in after)


@pytest.mark.timeout(240)
def test_a_group_whose_step_failed_releases_its_peer_waiting_in_the_all_reduce(tmp_path, lighthouse):  # noqa: F811
    (tmp_path / "pace").write_text("0.02")  # 0.3 s a step until both groups are in
    metrics = str(tmp_path / "m.jsonl")

    def args(replica):  # step-timeout=600: a peer that waited it out would outlast this test many times over
        return ["train", "--fault-tolerance", "min=1,heartbeat=1,timeout=60,step-timeout=600", "--lighthouse", lighthouse,
                "--replica-id", replica, "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp_path / 'pace'}",
                "--epochs", "100", "--max-steps", "300", "--metrics-file", metrics, "--log-every", "1"]

    with LaunchedJob(args("y"), out_dir=_mkdir(tmp_path / "y"), prefix=[sys.executable, ONE_SIDED, "fail-early", "5"]) as y, \
         LaunchedJob(args("x"), out_dir=_mkdir(tmp_path / "x")) as x:
        y.wait_for(lambda: sum(r["participants"] == 2 for r in _records(metrics)) >= 2, timeout=150)
        (tmp_path / "pace").write_text("0.002")
        y.wait_for(lambda: "before its all-reduce" in y.stderr(), timeout=60)
        step = int(y.stderr().split("ft_one_sided: step ", 1)[1].split(":")[0])
        # x was in step's all-reduce, waiting for y's part; y's closed group failed it at once
        x.wait_for(lambda: any(r["replica"] == "x" and r["step"] >= step + 3 for r in _records(metrics)), timeout=60)
        assert x.wait(timeout=120)[0] == 0 and y.wait(timeout=60)[0] == 0, x.stderr() + y.stderr()
        rx, ry = _result(x), _result(y)
    failed = [line for line in x.stderr().splitlines() if f"step {step} not committed" in line]
    assert failed and "Timed out" not in failed[0], x.stderr()
    assert rx["steps"] == ry["steps"] == 300 and rx["fault_tolerance"]["model_digest"] == ry["fault_tolerance"]["model_digest"]
