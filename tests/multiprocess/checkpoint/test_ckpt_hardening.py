"""Hostile and broken checkpoints: no code runs from a checkpoint folder, every malformed one is
one line (and resume falls back past it), one writer per folder, retention never leaves a
half-deleted checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dtrain
from dtrain import CheckpointError
from dtrain.checkpoint import list_checkpoints
from tests.logic.checkpoint.test_ckpt_hardening import (
    _cli,
    craft_metadata_attack,
)
from tests.paths import ROOT
from tests.support import run_cli


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_resume_under_ddp_falls_back_past_a_crafted_checkpoint(tmp_path):
    marker = tmp_path / "PWNED"
    folder = tmp_path / "ck"
    common = ["train", "--task", "digits", "--strategy", "ddp", "--checkpoint-dir", str(folder)]
    r = run_cli([*common, "--max-steps", "2", "--save-every", "1"], cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    craft_metadata_attack(folder / "step-00000002", marker)
    r = run_cli([*common, "--max-steps", "3", "--resume"], cwd=str(ROOT), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "skipping checkpoint" in r.stderr and "refused" in r.stderr and "resumed from" in r.stderr, r.stderr
    assert "step-00000001 at step 1" in r.stderr, r.stderr
    assert not marker.exists()


# -- one writer per folder -------------------------------------------------------------------------
HOLDER = textwrap.dedent(
    """
    import sys, time, dtrain
    ctx = dtrain.init("single")
    ctx.checkpoints(sys.argv[1])
    print("holding", flush=True)
    time.sleep(60)
    """
)


def _hold(tmp_path: Path, folder: Path) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_job_on_a_folder_is_one_line_and_a_dead_holder_is_taken_over(tmp_path, caplog, capsys):
    folder = tmp_path / "ck"
    proc = _hold(tmp_path, folder)
    try:
        holder = json.loads((folder / "dtrain.lock").read_text())
        assert holder["pid"] == proc.pid and {"host", "run_id", "started"} <= set(holder)
        r = run_cli(["train", "--task", "digits", "--max-steps", "1", "--checkpoint-dir", str(folder)], cwd=str(ROOT), timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "in use by run" in lines[0] and f"pid {proc.pid}" in lines[0], r.stderr
        assert not list_checkpoints(str(folder))
        code, out, _ = _cli(capsys, "ckpt", "ls", folder)
        assert code == 0 and f"in use by run pid-{proc.pid}@" in out, out
        ctx = dtrain.init("single")
        with pytest.raises(CheckpointError, match=rf"in use by run .*pid {proc.pid}"):
            ctx.checkpoints(str(folder))
        ctx.close()
    finally:
        proc.kill()
        proc.wait(10)
    caplog.set_level("WARNING", logger="dtrain")
    ctx = dtrain.init("single")
    ckpt = ctx.checkpoints(str(folder))  # the holder died (SIGKILL): taken over with a warning
    assert "no longer running; taking it over" in caplog.text
    assert json.loads((folder / "dtrain.lock").read_text())["pid"] == os.getpid()
    ctx.close()
    assert not (folder / "dtrain.lock").exists()  # released at close
    del ckpt


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_checkpoint_dir_that_is_a_file_fails_at_start(tmp_path):
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file", tmp_path / "file" / "sub"):
        r = run_cli(["train", "--task", "digits", "--max-steps", "1", "--checkpoint-dir", str(target)], cwd=str(ROOT), timeout=90)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and str(target) in lines[0] and "--checkpoint-dir" in lines[0], r.stderr
        assert not r.stdout.strip(), r.stdout  # nothing trained
