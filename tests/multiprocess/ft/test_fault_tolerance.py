"""`dtrain train --fault-tolerance` on torchft: 2 replica groups on this host, one killed (-9) mid-run;
the survivor keeps committing steps without a restart, the killed one restarted heals from the
survivor's memory; the ledger holds every committed step's samples exactly once; the Lighthouse
lost or too few replica groups: one line and a clean stop."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import psutil
import pytest
import torch

from dtrain.checkpoint import read_checkpoint
from dtrain.checkpoint.validate import newest_valid
from dtrain.ft.ledger import check_ft_ledger
from tests.support.procs import LaunchedJob

pytest.importorskip("torchft")


def _records(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def _cmdline(process):
    """A job's process's command line; "" for one that has ended (``descendants`` remembers every
    process it saw, short-lived helpers too)."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _result(job):
    return json.loads([line for line in job.stdout().splitlines() if line.startswith("{")][-1])


def _lighthouse(job):
    found = re.search(r"--lighthouse (\S+)", job.stderr())
    return found.group(1) if found else None


def _args(tmp_path, replica, *extra):
    return ["train", "--fault-tolerance", "min=1,heartbeat=1,timeout=30", "--task", "tests.user_task:make_paced",
            "--task-arg", f"pace_file={tmp_path / 'pace'}", "--epochs", "30", "--replica-id", replica,
            "--ledger", str(tmp_path / "ledger"), "--metrics-file", str(tmp_path / "metrics.jsonl"), "--log-every", "1",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "25", *extra]


def _mkdir(path):
    os.makedirs(path)
    return str(path)


def _model_state(folder):
    path, _ = newest_valid(folder)
    return path, read_checkpoint(path, map_location="cpu")["objects"]["model"]


@pytest.mark.timeout(300)
def test_a_killed_replica_group_leaves_the_survivor_stepping_and_heals_when_back(tmp_path):
    (tmp_path / "pace").write_text("0.004")  # 16 samples a step: ~65 ms, long enough to kill mid-run
    metrics = str(tmp_path / "metrics.jsonl")
    with LaunchedJob(_args(tmp_path, "a"), out_dir=_mkdir(tmp_path / "a")) as a:
        a.wait_for(lambda: _lighthouse(a) is not None, timeout=120)
        addr = _lighthouse(a)
        with LaunchedJob(_args(tmp_path, "b", "--lighthouse", addr), out_dir=_mkdir(tmp_path / "b1")) as b:
            b.wait_for(lambda: sum(r["replica"] == "b" and r["participants"] == 2 for r in _records(metrics)) >= 10, timeout=120)
            survivor = {p.pid for p in a.descendants()}
            b.signal(signal.SIGKILL)  # b is the replica group's own process (started by hand)
            killed_at = time.time()
            assert b.wait(timeout=30)[0] == -signal.SIGKILL
        # The survivor goes on alone, in the same process: no restart, no checkpoint read.
        a.wait_for(lambda: sum(r["replica"] == "a" and r["participants"] == 1 and r["time"] > killed_at
                               for r in _records(metrics)) >= 5, timeout=60)
        assert {p.pid for p in a.descendants()} == survivor
        with LaunchedJob(_args(tmp_path, "b", "--lighthouse", addr), out_dir=_mkdir(tmp_path / "b2")) as b2:
            b2.wait_for(lambda: any(r["replica"] == "b" and r["time"] > killed_at for r in _records(metrics)), timeout=120)
            (tmp_path / "pace").write_text("0")  # back in: let the job finish
            assert b2.wait(timeout=180)[0] == 0, b2.stderr()
        assert a.wait(timeout=120)[0] == 0, a.stderr()
        ra, rb = _result(a), _result(b2)
    assert ra["steps"] == rb["steps"] > 0
    # b healed from a's memory after its restart; a healed at most when it joined (b may have started first).
    kill_step = max(r["step"] for r in _records(metrics) if r["time"] <= killed_at)
    assert max(rb["fault_tolerance"]["healed_at_steps"]) > kill_step
    assert all(s <= kill_step for s in ra["fault_tolerance"]["healed_at_steps"])
    assert ra["fault_tolerance"]["participants_min"] == 1 and ra["fault_tolerance"]["participants_max"] == 2
    assert ra["fault_tolerance"]["batch_rule"] == "per-replica"
    back = [r for r in _records(metrics) if r["replica"] == "b" and r["time"] > killed_at]
    assert back and all(r["participants"] == 2 for r in back)
    # Every committed step once, across both groups and the kill; the same step count everywhere.
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == ra["steps"]
    assert all(e.duplicated == 0 for e in report.epochs)
    # The healed group ends with its peer's state, bit for bit (both saved their last step).
    (pa, sa), (pb, sb) = _model_state(str(tmp_path / "ckpt" / "replica-a")), _model_state(str(tmp_path / "ckpt" / "replica-b"))
    assert os.path.basename(pa) == os.path.basename(pb)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.timeout(180)
def test_too_few_replica_groups_stop_with_one_line_and_a_checkpoint(tmp_path):
    os.makedirs(tmp_path / "out")
    args = ["train", "--fault-tolerance", "min=2,timeout=3", "--task", "tests.user_task:make", "--checkpoint-dir",
            str(tmp_path / "ckpt")]
    with LaunchedJob(args, out_dir=str(tmp_path / "out")) as job:
        rc, _ = job.wait(timeout=150)
        err = job.stderr()
    errors = [line for line in err.splitlines() if line.startswith("dtrain: error:")]
    assert rc == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and "no quorum within 3 s" in errors[0] and "min=2" in errors[0], err
    assert newest_valid(str(tmp_path / "ckpt" / "replica-0"))[0] is not None  # saved before it stopped


@pytest.mark.timeout(240)
def test_the_lighthouse_lost_stops_the_others_with_one_line(tmp_path):
    (tmp_path / "pace").write_text("0.004")
    metrics = str(tmp_path / "metrics.jsonl")
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    with LaunchedJob(_args(tmp_path, "a"), out_dir=str(tmp_path / "a")) as a:
        a.wait_for(lambda: _lighthouse(a) is not None, timeout=120)
        extra = ["--lighthouse", _lighthouse(a)]
        args = [x if x != "min=1,heartbeat=1,timeout=30" else "min=1,heartbeat=1,timeout=5" for x in _args(tmp_path, "b", *extra)]
        with LaunchedJob(args, out_dir=str(tmp_path / "b")) as b:
            b.wait_for(lambda: sum(r["replica"] == "b" for r in _records(metrics)) >= 5, timeout=120)
            a.kill_all()  # the first node: its Lighthouse and its replica group
            rc, _ = b.wait(timeout=120)
            err = b.stderr()
    errors = [line for line in err.splitlines() if line.startswith("dtrain: error:")]
    assert rc == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and "no quorum within 5 s" in errors[0], err
    assert newest_valid(str(tmp_path / "ckpt" / "replica-b"))[0] is not None


@pytest.mark.timeout(300)
def test_a_whole_job_restarted_with_resume_goes_on_from_its_checkpoint(tmp_path):
    """Disk checkpoints still work: a job lost whole resumes from its replica group's folder, and the
    ledger counts the steps the first attempt committed after that checkpoint (the second redid them) once."""
    base = ["train", "--fault-tolerance", "--task", "tests.user_task:make", "--epochs", "20", "--replica-id", "a",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "10", "--ledger", str(tmp_path / "ledger")]
    with LaunchedJob([*base, "--max-steps", "30"], out_dir=_mkdir(tmp_path / "one")) as one:
        assert one.wait(timeout=240)[0] == 0, one.stderr()
    # As if the job had been lost after step 30 but before its save: the newest checkpoint is step 20's.
    folder = tmp_path / "ckpt" / "replica-a"
    path, _ = newest_valid(str(folder))
    assert os.path.basename(path) == "step-00000030"
    shutil.rmtree(path)
    (folder / "latest").unlink(missing_ok=True)
    with LaunchedJob([*base, "--max-steps", "45", "--resume"], out_dir=_mkdir(tmp_path / "two")) as two:
        assert two.wait(timeout=240)[0] == 0, two.stderr()
        assert "resumed from" in two.stderr() and "at step 20" in two.stderr(), two.stderr()
        result = _result(two)
    assert result["steps"] == 45
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == 45


@pytest.mark.timeout(180)
def test_a_lighthouse_nobody_listens_at_is_one_line(tmp_path):
    with LaunchedJob(["train", "--fault-tolerance", "--lighthouse", "127.0.0.1:1", "--task", "tests.user_task:make"],
                     out_dir=_mkdir(tmp_path / "out")) as job:
        rc, _ = job.wait(timeout=150)
        err = job.stderr()
    errors = [line for line in err.splitlines() if line.startswith("dtrain: error:")]
    assert rc == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and "cannot reach the Lighthouse at http://127.0.0.1:1" in errors[0], err


@pytest.mark.timeout(300)
def test_the_launcher_restarts_a_killed_group_which_heals(tmp_path):
    """--nproc 2 --max-restarts 1: a replica group's process killed (-9) is started again by the
    launcher, heals from the other, and the job ends with both groups at the same step."""
    (tmp_path / "pace").write_text("0.004")
    metrics = str(tmp_path / "metrics.jsonl")
    args = ["train", "--fault-tolerance", "min=1,heartbeat=1", "--nproc", "2", "--max-restarts", "1",
            "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp_path / 'pace'}", "--epochs", "30",
            "--metrics-file", metrics, "--log-every", "1", "--ledger", str(tmp_path / "ledger")]
    with LaunchedJob(args, out_dir=_mkdir(tmp_path / "out")) as job:
        job.wait_for(lambda: {r["replica"] for r in _records(metrics)[-6:] if r["participants"] == 2} == {"0-0", "0-1"},
                     timeout=180)
        victim = next(p for p in job.descendants() if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p))
        victim.kill()
        killed_at = time.time()
        job.wait_for(lambda: sum(r["participants"] == 2 and r["time"] > killed_at + 1 for r in _records(metrics)) >= 4,
                     timeout=180)  # both groups again: the restarted one healed and steps with the other
        (tmp_path / "pace").write_text("0")
        rc, _ = job.wait(timeout=240)
        err, results = job.stderr(), [json.loads(line) for line in job.stdout().splitlines() if line.startswith("{")]
    assert rc == 0, err
    assert "restart 1 of 1" in err and "signal SIGKILL" in err
    assert len(results) == 2 and results[0]["steps"] == results[1]["steps"]
    assert any(max(r["fault_tolerance"]["healed_at_steps"], default=0) > 0 for r in results)
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == results[0]["steps"]
