"""A step committed by one side only (torchft's vote counts a group's own processes; defect B in
docs/fault-tolerance.md), made on purpose (tests/scripts/ft_one_sided.py): group y's vote on step S
fails after its all-reduce completed, group x commits S. If x lives, y heals from x at the next
quorum (x is one step ahead) and both end with one model; if x dies right after its commit, y
commits S again alone and the ledger's check reads the surviving line: every sample once."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dtrain.ft.ledger import check_ft_ledger
from tests.multiprocess.ft.test_fault_tolerance import _mkdir, _records, _result
from tests.paths import TESTS
from tests.support.procs import LaunchedJob

pytest.importorskip("torchft")

ONE_SIDED = str(TESTS / "scripts" / "ft_one_sided.py")
K = 5  # S: the 5th step after the first one both groups try together


@pytest.fixture
def lighthouse():
    """A Lighthouse of the test's own, so that both groups run in their own process (the fault is
    injected there) and neither group's death takes the Lighthouse with it."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100, heartbeat_timeout_ms=1000)
    yield "127.0.0.1:" + server.address().rpartition(":")[2]
    server.shutdown()


def _args(tmp_path, replica, lighthouse):
    return ["train", "--fault-tolerance", "min=1,heartbeat=1,timeout=60", "--lighthouse", lighthouse, "--replica-id", replica,
            "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp_path / 'pace'}", "--epochs", "100",
            "--max-steps", "300", "--ledger", str(tmp_path / "ledger"), "--metrics-file", str(tmp_path / "m.jsonl"), "--log-every", "1"]


def _ledger_lines(tmp_path, replica):
    folder = tmp_path / "ledger"
    names = [n for n in os.listdir(folder) if n.startswith(f"ft-{replica}-")]
    assert len(names) == 1, names
    with open(folder / names[0]) as f:
        return [json.loads(line) for line in f]


def _both_in(tmp_path):
    return sum(r["participants"] == 2 for r in _records(str(tmp_path / "m.jsonl"))) >= 2


@pytest.mark.timeout(240)
def test_the_group_behind_a_one_sided_commit_heals_from_the_one_ahead(tmp_path, lighthouse):
    (tmp_path / "pace").write_text("0.02")  # 0.3 s a step until both groups are in
    with LaunchedJob(_args(tmp_path, "y", lighthouse), out_dir=_mkdir(tmp_path / "y"),
                     prefix=[sys.executable, ONE_SIDED, "vote-no", str(K)]) as y, \
         LaunchedJob(_args(tmp_path, "x", lighthouse), out_dir=_mkdir(tmp_path / "x")) as x:
        y.wait_for(lambda: _both_in(tmp_path), timeout=150)
        (tmp_path / "pace").write_text("0.002")
        assert x.wait(timeout=150)[0] == 0, x.stderr()
        assert y.wait(timeout=60)[0] == 0, y.stderr()
        rx, ry = _result(x), _result(y)
    step = int(y.stderr().split("ft_one_sided: step ", 1)[1].split(":")[0])
    assert f"step {step} not committed (injected" in y.stderr(), y.stderr()
    # x committed S alone; y, one step behind, healed to S from x at the next quorum
    assert any(r.get("s") == step for r in _ledger_lines(tmp_path, "x"))
    assert not any(r.get("s") == step for r in _ledger_lines(tmp_path, "y"))
    assert step in ry["fault_tolerance"]["healed_at_steps"]
    assert rx["steps"] == ry["steps"] == 300
    assert rx["fault_tolerance"]["model_digest"] == ry["fault_tolerance"]["model_digest"]
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == 300


@pytest.mark.timeout(240)
def test_a_one_sided_commit_lost_with_its_group_is_committed_again_and_counted_once(tmp_path, lighthouse):
    (tmp_path / "pace").write_text("0.02")
    with LaunchedJob(_args(tmp_path, "y", lighthouse), out_dir=_mkdir(tmp_path / "y"),
                     prefix=[sys.executable, ONE_SIDED, "vote-no", str(K)]) as y, \
         LaunchedJob(_args(tmp_path, "x", lighthouse), out_dir=_mkdir(tmp_path / "x"),
                     prefix=[sys.executable, ONE_SIDED, "die-after", str(K)]) as x:
        y.wait_for(lambda: _both_in(tmp_path), timeout=150)
        (tmp_path / "pace").write_text("0.002")
        assert x.wait(timeout=150)[0] == -9, x.stderr()
        assert y.wait(timeout=150)[0] == 0, y.stderr()
        ry = _result(y)
    step = int(y.stderr().split("ft_one_sided: step ", 1)[1].split(":")[0])
    assert f"ft_one_sided: step {step} committed and written" in x.stderr()
    # two records of S: x's (both groups' samples, its last line) and y's own, later, alone
    (sx,), (sy,) = ([r for r in _ledger_lines(tmp_path, g) if r.get("s") == step] for g in ("x", "y"))
    assert _ledger_lines(tmp_path, "x")[-1] == sx and sy["t"] > sx["t"] and len(sy["i"]) < len(sx["i"])
    assert ry["steps"] == 300 and ry["fault_tolerance"]["participants_min"] == 1
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == 300
    assert all(e.duplicated == 0 for e in report.epochs)
