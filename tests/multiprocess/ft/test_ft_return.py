"""A replica group that its launcher restarts after its peer has finished the job (issue 55): it
must not train the job again from step 0, alone (before: a second result line, another model).
With checkpoints it reads the peer's last one and stops with one line; without, it waits
``timeout`` for a live peer and stops with one line. Either way the job exits 0 with one result."""

from __future__ import annotations

import json
import os
import time

import pytest

from dtrain.ft.ledger import check_ft_ledger
from tests.support.procs import LaunchedJob

pytest.importorskip("torchft")


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "none"])
def test_a_group_restarted_after_the_job_ended_does_not_train_it_again(tmp_path, checkpoints):
    pace, gate, metrics = tmp_path / "pace", tmp_path / "gate", str(tmp_path / "metrics.jsonl")
    pace.write_text("0.004")
    args = ["train", "--fault-tolerance", "min=1,heartbeat=1,timeout=8", "--nproc", "2", "--max-restarts", "1",
            "--task", "tests.multiprocess.ft.gated_task:make_gated", "--task-arg", f"pace_file={pace}",
            "--task-arg", f"gate_file={gate}", "--metrics-file", metrics, "--log-every", "1",
            "--ledger", str(tmp_path / "ledger")]
    if checkpoints:
        args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "20"]
    os.makedirs(tmp_path / "out")
    with LaunchedJob(args, out_dir=str(tmp_path / "out")) as job:
        job.wait_for(lambda: {r["replica"] for r in _records(metrics)[-6:] if r["participants"] == 2} == {"0-0", "0-1"},
                     timeout=180)
        gate.write_text("hold")  # the restarted process waits in its task's build
        victim = next(p for p in job.descendants() if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker"
                      not in " ".join(p.cmdline()))
        victim.kill()
        killed_at = time.time()
        pace.write_text("0")
        job.wait_for(lambda: job.stdout().count("\n") >= 1, timeout=180)  # the survivor's result: the job is done
        gate.write_text("go")
        rc, _ = job.wait(timeout=120)
        out, err = job.stdout(), job.stderr()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rc == 0 and len(results) == 1, (out, err)
    assert "restart 1 of 1" in err and "Traceback" not in err, err
    back = [r for r in _records(metrics) if r["time"] > killed_at and r["replica"] != results[0]["replica"]]
    assert back == [], back[:3]  # the restarted group committed nothing
    if checkpoints:
        assert "the job has ended (its epochs were done at step" in err, err
    else:
        errors = [line for line in err.splitlines() if line.startswith("dtrain: error:")]
        assert len(errors) == 1 and "restarted, but alone in its quorum for 8 s at step 0" in errors[0], err
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == results[0]["steps"]


@pytest.mark.timeout(300)
def test_a_scripts_group_restarted_after_the_job_ended_does_not_train_it_again(tmp_path):
    # dtrain run --fault-tolerance (a user's loop): before, the restarted group trained the whole
    # job again alone (1720 steps after the kill here) and printed a second, different result
    from tests.paths import ROOT

    script = str(ROOT / "tests" / "multiprocess" / "ft" / "gated_loop.py")
    pace, gate, commits = tmp_path / "pace", tmp_path / "gate", str(tmp_path / "commits.jsonl")
    pace.write_text("0.004")
    args = ["run", "--fault-tolerance", "min=1,heartbeat=1,timeout=8", "-n", "2", "--max-restarts", "1", script,
            str(pace), commits, "--ledger", str(tmp_path / "ledger"), "--epochs", "40"]
    os.makedirs(tmp_path / "out")
    with LaunchedJob(args, out_dir=str(tmp_path / "out"), cwd=str(ROOT), env={"GATE_FILE": str(gate)}) as job:
        job.wait_for(lambda: all(sum(c["replica"] == r for c in _records(commits)) >= 10 for r in ("0-0", "0-1")),
                     timeout=240)
        gate.write_text("hold")  # the restarted script waits before dtrain.init
        victim = next(p for p in job.descendants() if script in " ".join(p.cmdline())
                      and p.environ().get("DTRAIN_FT_REPLICA") == "0-1")
        victim.kill()
        killed_at = time.time()
        pace.write_text("0")
        # the survivor's result line (the script prints its epochs' losses first): the job is done
        job.wait_for(lambda: any(line.startswith("{") for line in job.stdout().splitlines()), timeout=180)
        gate.write_text("go")
        rc, _ = job.wait(timeout=120)
        out, err = job.stdout(), job.stderr()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rc == 0 and len(results) == 1 and results[0]["replica"] == "0-0", (out, err)
    assert "restart 1 of 1" in err and "Traceback" not in err, err
    assert [c for c in _records(commits) if c["replica"] == "0-1" and c["time"] > killed_at] == []
    errors = [line for line in err.splitlines() if line.startswith("dtrain: error:")]
    assert len(errors) == 1 and "0-1: restarted, but alone in its quorum for 8 s at step 0" in errors[0], err
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == []
