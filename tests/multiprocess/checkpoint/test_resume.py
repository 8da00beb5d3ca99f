"""Resume end to end, through `dtrain train` and `dtrain run`: bitwise-identical after a clean
stop and after kill -9 under --max-restarts, exactly-once data across world sizes, a corrupt
newest checkpoint, a checkpoint of another model."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest
import torch

import dtrain
from tests.paths import ROOT
from tests.support import faults, run_ckpt, run_cli

TASK = "tests.user_task:make_dropout"  # 256 samples, batch 16, 2 epochs: 16 steps on 2 processes

pytestmark = pytest.mark.slow


def _train(args, task=TASK, **kw):
    r = run_cli(["train", "--task", task, *args], cwd=str(ROOT), **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _identical(a, b) -> None:
    code, out = run_ckpt("diff", a, b)
    assert code == 0 and "identical" in out, out[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run on 2 processes; its final checkpoint is what every resume must match."""
    ref = tmp_path_factory.mktemp("reference")
    result, _ = _train(["-n", "2", "--checkpoint-dir", str(ref)], timeout=240)
    assert result["steps"] == 16
    return ref


@pytest.mark.timeout(400)
def test_clean_stop_then_resume_past_a_corrupt_latest_is_bitwise_identical(tmp_path, reference):
    part = tmp_path / "part"
    _train(["-n", "2", "--checkpoint-dir", str(part), "--max-steps", "11", "--save-every", "4"], timeout=240)  # mid-epoch 1
    state = part / "step-00000011" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the newest checkpoint
    state.write_bytes(bytes(data))
    code, out = run_ckpt("verify", part)
    assert code == 1 and "FAIL" in out and "checksum" in out, out
    resumed, err = _train(["-n", "2", "--checkpoint-dir", str(part), "--resume"], timeout=240)
    assert "skipping checkpoint" in err and "step-00000011" in err and "fails its sha256 checksum" in err, err
    assert "step-00000008 at step 8" in err and resumed["steps"] == 16, err
    _identical(reference, part)
    out = run_ckpt("ls", part)[1]
    assert "valid     step-00000016 <- latest" in out, out  # the corrupt one stays, for inspection


@pytest.mark.timeout(400)
def test_kill_9_at_a_random_step_under_max_restarts_resumes_and_matches(tmp_path, reference):
    rank, step = random.randrange(2), random.randrange(1, 16)  # any draw must pass; printed on failure
    crashed = tmp_path / "crashed"
    r = run_cli(["train", "--task", TASK, "-n", "2", "--checkpoint-dir", str(crashed), "--save-every", "3",
                 "--max-restarts", "2"], cwd=str(ROOT), timeout=300, env=faults.env(rank, step))
    where = f"rank {rank} killed after step {step}"
    assert r.returncode == 0, f"{where}\n{r.stderr[-3000:]}"
    saved = 3 * ((step - 1) // 3)  # the kill comes before step's own save
    if saved:
        assert f"step-{saved:08d} at step {saved}" in r.stderr, f"{where}\n{r.stderr[-3000:]}"  # redid < 3 steps
    else:
        assert "resumed from" not in r.stderr, where
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 16
    _identical(reference, crashed)


@pytest.mark.timeout(400)
def test_resume_on_2_then_1_then_2_processes_uses_each_sample_once_per_epoch(tmp_path):
    """2 processes stop after 3 steps (96 samples), 1 process continues for 4 (64 more), 2 processes
    finish epoch 0 (96) and run epoch 1: every sample exactly once in each epoch."""
    ck, logs = tmp_path / "ck", [tmp_path / f"log{i}" for i in range(3)]
    runs = [["-n", "2", "--max-steps", "3"], ["-n", "1", "--resume", "--max-steps", "7"], ["-n", "2", "--resume"]]
    for log, args in zip(logs, runs):
        log.mkdir()
        result, _ = _train([*args, "--checkpoint-dir", str(ck), "--task-arg", f"log_dir={log}"],
                           task="tests.user_task:make_logged", timeout=240)
    assert result["steps"] == 3 + 4 + 3 + 8  # the last run ends with epoch 1, not after a fixed step count
    served = [[int(v) for v in f.read_text().split()] for log in logs for f in sorted(log.iterdir())]
    epoch0 = [i for s in served[:3] for i in s] + [i for s in served[3:] for i in s[:48]]  # last run: 48 per rank first
    epoch1 = [i for s in served[3:] for i in s[48:]]
    assert sorted(epoch0) == list(range(256)), collections.Counter(epoch0).most_common(3)
    assert sorted(epoch1) == list(range(256)), collections.Counter(epoch1).most_common(3)


@pytest.mark.timeout(120)
def test_resume_into_another_model_is_one_clear_line(tmp_path):
    from tests.user_task import make

    ctx = dtrain.init("single")
    ctx.checkpoints(str(tmp_path)).save(2, model=ctx.setup(make(hidden=16)["build_model"]()))
    ctx.close()
    r = run_cli(["train", "--task", "tests.user_task:make", "--task-arg", "hidden=32", "--checkpoint-dir", str(tmp_path),
                 "--resume"], cwd=str(ROOT), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "step-00000002 does not fit this model: shape mismatch 0.weight (16, 4) vs (32, 4)" in lines[-1]


@pytest.mark.timeout(300)
def test_user_script_under_dtrain_run_max_restarts_resumes_and_matches(tmp_path):
    script = str(ROOT / "examples" / "checkpoint_resume.py")
    outs = {}
    for name, extra in (("ref", []), ("crash", ["--crash", f"{random.randrange(2)}:{random.randrange(4, 16)}"])):
        r = run_cli(["run", "-n", "2", "--max-restarts", "1", script, str(tmp_path / name), *extra], timeout=240)
        assert r.returncode == 0, f"{extra}\n{r.stderr[-3000:]}"
        outs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["ref"]["restarts"] == 0 and outs["crash"]["restarts"] == 1 and outs["crash"]["resumed_from"] >= 3
    assert outs["crash"]["steps"] == outs["ref"]["steps"] == 16
    _identical(tmp_path / "ref", tmp_path / "crash")  # model, Adam, StepLR and data position
    state = torch.load(tmp_path / "crash" / "step-00000016" / "state.pt", weights_only=True)
    assert set(state["objects"]) == {"model", "optimizer", "scheduler", "loader"} and len(state["rng"]) == 2
