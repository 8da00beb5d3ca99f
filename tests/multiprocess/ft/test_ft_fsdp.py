"""`dtrain train --fault-tolerance --strategy fsdp --nproc 2`: a replica group of 2 processes with the
model sharded over them (FSDP), replicated across groups by torchft (each rank averages its
gradient shard with the other group's same rank). 2 groups x 2 processes on this host: the same
parameters as one process on the whole set (what plain fsdp on 4 ranks computes); a group that
loses a process is restarted whole by its launcher, heals each rank's shards from the other group's
same rank, and ends equal to it; the ledger holds every committed step once."""

from __future__ import annotations

import json
import os
import re
import time

import psutil
import pytest
import torch

from dtrain.checkpoint import read_checkpoint
from dtrain.checkpoint.sharded import consolidated
from dtrain.checkpoint.validate import newest_valid
from dtrain.ft.ledger import check_ft_ledger
from tests.support.procs import LaunchedJob

from .test_fault_tolerance import _records

pytest.importorskip("torchft")

TASK = "tests.multiprocess.ft.fsdp_task:make"


def _mkdir(path):
    os.makedirs(path)
    return str(path)


def _lighthouse(job):
    found = re.search(r"--lighthouse (\S+)", job.stderr())
    return found.group(1) if found else None


def _result(job):
    return json.loads([line for line in job.stdout().splitlines() if line.startswith("{")][-1])


def _model(folder):
    """The newest checkpoint's step name and its whole model (the shards of a sharded checkpoint joined)."""
    path, _ = newest_valid(folder)
    if not os.path.isdir(os.path.join(path, "sharded")):  # one process's checkpoint: the model whole
        return os.path.basename(path), read_checkpoint(path, map_location="cpu")["objects"]["model"]
    return os.path.basename(path), consolidated(path)["model"]


def one_process(tmp_path, task, batch, *task_args):
    """The reference: ``task`` in one process, ``batch`` samples a step (the whole training set, which
    the tested run's groups and ranks split); the mean gradient does not depend on the split, so this
    is what plain fsdp (or dp x tp) on 4 ranks computes, without their 4 spawns (~6 s of 2 cores)."""
    with LaunchedJob(["train", "-n", "1", "--batch-size", str(batch), "--task", task, *task_args,
                      "--checkpoint-dir", str(tmp_path / "plain")], out_dir=_mkdir(tmp_path / "plain-out")) as plain:
        assert plain.wait(timeout=300)[0] == 0, plain.stderr()
    return _model(str(tmp_path / "plain"))


def _group(tmp_path, replica, ft, *extra):
    return ["train", "--fault-tolerance", ft, "--strategy", "fsdp", "--nproc", "2", "--task", TASK, "--replica-id", replica,
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--ledger", str(tmp_path / "ledger"),
            "--metrics-file", str(tmp_path / "metrics.jsonl"), "--log-every", "1", *extra]


def _two_groups(tmp_path, ft, b_extra=(), a_extra=()):
    """Group a (node 0: the Lighthouse) and group b joining it, each 2 processes; yields both jobs."""
    a = LaunchedJob(_group(tmp_path, "a", ft, *a_extra), out_dir=_mkdir(tmp_path / "a"))
    a.__enter__()
    try:
        a.wait_for(lambda: _lighthouse(a) is not None, timeout=120)
        b = LaunchedJob(_group(tmp_path, "b", ft, "--lighthouse", _lighthouse(a), *b_extra), out_dir=_mkdir(tmp_path / "b"))
        return a, b.__enter__()
    except BaseException:
        a.__exit__(None, None, None)
        raise


@pytest.mark.timeout(420)
def test_fsdp_in_two_replica_groups_trains_as_plain_fsdp_on_four_ranks(tmp_path):
    """Every step is the whole training set (32 samples: 2 groups x 2 processes x 8, min=2 so both
    groups are in every step), so the mean gradient is the same sum in another order: the
    parameters after 6 steps equal one process's on the whole set (plain fsdp's on 4 ranks too)
    within float32 rounding, and the 2 groups' bit for bit."""
    a, b = _two_groups(tmp_path, "min=2,heartbeat=1,timeout=60")
    try:
        assert b.wait(timeout=300)[0] == 0, b.stderr()
        assert a.wait(timeout=120)[0] == 0, a.stderr()
        ra, rb = _result(a), _result(b)
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    assert ra["steps"] == rb["steps"] == 6
    assert ra["fault_tolerance"]["processes_per_replica"] == 2 and ra["fault_tolerance"]["batch_per_replica"] == 16
    assert ra["fault_tolerance"]["participants_min"] == 2 and ra["fault_tolerance"]["steps_not_committed"] == 0
    (sa, ma), (sb, mb), (sp, mp) = (_model(str(tmp_path / "ckpt" / "replica-a")), _model(str(tmp_path / "ckpt" / "replica-b")),
                                    one_process(tmp_path, TASK, 32))
    assert sa == sb == sp == "step-00000006"
    assert ma.keys() == mb.keys() == mp.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    for k in ma:  # without the groups' average each would train on its half: far off, not rounding
        torch.testing.assert_close(ma[k], mp[k], rtol=1e-5, atol=1e-6)
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == 6


@pytest.mark.timeout(480)
def test_a_group_that_loses_a_process_is_restarted_whole_and_heals_each_shard(tmp_path):
    """One process of group b killed (-9) mid-run: b's launcher kills its other process and starts
    the group again (--max-restarts 1); group a goes on alone in the same processes; b's ranks each
    heal from a's same rank; both end with the same sharded model, bit for bit; the ledger exactly once."""
    (tmp_path / "pace").write_text("0.01")  # 8 samples a process: ~80 ms a step, long enough to kill mid-run
    metrics = str(tmp_path / "metrics.jsonl")
    paced = ("--task-arg", f"pace_file={tmp_path / 'pace'}", "--task-arg", "epochs=400", "--save-every", "100")
    a, b = _two_groups(tmp_path, "min=1,heartbeat=1,timeout=60", b_extra=(*paced, "--max-restarts", "1"), a_extra=paced)
    try:
        b.wait_for(lambda: sum(r["replica"] == "b" and r["participants"] == 2 for r in _records(metrics)) >= 5, timeout=180)
        survivors = {p.pid for p in a.descendants() if p.is_running()}
        victim = [p for p in b.descendants() if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p)][-1]
        victim.kill()
        killed_at = time.time()
        a.wait_for(lambda: sum(r["replica"] == "a" and r["participants"] == 1 and r["time"] > killed_at
                               for r in _records(metrics)) >= 3, timeout=120)
        b.wait_for(lambda: sum(r["replica"] == "b" and r["time"] > killed_at for r in _records(metrics)) >= 3, timeout=240)
        (tmp_path / "pace").write_text("0")  # back in: let the job finish
        assert b.wait(timeout=300)[0] == 0, b.stderr()
        assert a.wait(timeout=120)[0] == 0, a.stderr()
        assert survivors <= {p.pid for p in a.descendants()}  # no restart on a's side
        ra, rb, err = _result(a), _result(b), b.stderr()
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    assert "restart 1 of 1" in err and "signal SIGKILL" in err, err
    assert ra["steps"] == rb["steps"] > 0
    kill_step = max(r["step"] for r in _records(metrics) if r["time"] <= killed_at)
    assert max(rb["fault_tolerance"]["healed_at_steps"]) > kill_step
    assert ra["fault_tolerance"]["participants_min"] == 1 and ra["fault_tolerance"]["participants_max"] == 2
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == ra["steps"]
    assert all(e.duplicated == 0 for e in report.epochs)
    (sa, ma), (sb, mb) = _model(str(tmp_path / "ckpt" / "replica-a")), _model(str(tmp_path / "ckpt" / "replica-b"))
    assert sa == sb and ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def _cmdline(process):
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""
