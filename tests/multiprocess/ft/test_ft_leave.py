"""A stop signal to a replica group of ``dtrain train --fault-tolerance``: a clean leave at the next step
boundary (a checkpoint, its result line, exit status 143, not restarted) while the others go on; to the
launcher: every group leaves so, each with its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from dtrain.checkpoint.store import step_name
from dtrain.checkpoint.validate import newest_valid
from tests.support.procs import LaunchedJob

from .test_fault_tolerance import _args, _lighthouse, _mkdir, _records

pytest.importorskip("torchft")


def _results(job):
    return [json.loads(line) for line in job.stdout().splitlines() if line.startswith("{")]


@pytest.mark.timeout(300)
def test_a_group_signalled_leaves_cleanly_and_the_other_goes_on(tmp_path):
    (tmp_path / "pace").write_text("0.004")
    metrics = str(tmp_path / "metrics.jsonl")
    with LaunchedJob(_args(tmp_path, "a"), out_dir=_mkdir(tmp_path / "a")) as a:
        a.wait_for(lambda: _lighthouse(a) is not None, timeout=120)
        with LaunchedJob(_args(tmp_path, "b", "--lighthouse", _lighthouse(a)), out_dir=_mkdir(tmp_path / "b")) as b:
            b.wait_for(lambda: sum(r["replica"] == "b" and r["participants"] == 2 for r in _records(metrics)) >= 5, timeout=120)
            b.signal(signal.SIGTERM)
            signalled_at = time.time()
            rc_b, _ = b.wait(timeout=60)
            err_b, left = b.stderr(), _results(b)
        a.wait_for(lambda: sum(r["replica"] == "a" and r["participants"] == 1 and r["time"] > signalled_at
                               for r in _records(metrics)) >= 5, timeout=60)
        (tmp_path / "pace").write_text("0")
        rc_a, _ = a.wait(timeout=240)
        done = _results(a)
    assert rc_b == 143 and "Traceback" not in err_b, err_b
    assert "SIGTERM received; left the job after step" in err_b and len(left) == 1 and left[0]["left"] == "SIGTERM"
    path, _ = newest_valid(str(tmp_path / "ckpt" / "replica-b"))
    assert os.path.basename(path) == step_name(left[0]["steps"])  # saved where it left
    assert rc_a == 0 and done[0]["left"] is None and done[0]["steps"] > left[0]["steps"]
    # b left between steps: a lost no step to it (a kill mid-step costs one not committed)
    assert done[0]["fault_tolerance"]["steps_not_committed"] == 0, done


@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_makes_every_group_leave_with_a_checkpoint(tmp_path):
    (tmp_path / "pace").write_text("0.004")
    metrics = str(tmp_path / "metrics.jsonl")
    args = ["train", "--fault-tolerance", "min=1,heartbeat=1", "--nproc", "2", "--max-restarts", "3",
            "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp_path / 'pace'}", "--epochs", "30",
            "--metrics-file", metrics, "--log-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt")]
    with LaunchedJob(args, out_dir=_mkdir(tmp_path / "out")) as job:
        job.wait_for(lambda: {r["replica"] for r in _records(metrics)[-6:] if r["participants"] == 2} == {"0-0", "0-1"},
                     timeout=180)
        job.signal(signal.SIGTERM)
        rc, _ = job.wait(timeout=60)
        err, results = job.stderr(), _results(job)
        assert job.survivors(after_s=5) == []
    assert rc == 143 and "Traceback" not in err and "restart 1 of" not in err, err
    assert sorted(r["replica"] for r in results) == ["0-0", "0-1"] and all(r["left"] == "SIGTERM" for r in results)
    for r in results:
        path, _ = newest_valid(str(tmp_path / "ckpt" / f"replica-{r['replica']}"))
        assert os.path.basename(path) == step_name(r["steps"])
