"""Every checkpoint of a run restarted under --max-restarts holds the uninterrupted run's data
position (issue 51: a worker killed after the final save made the restart resume from the final
checkpoint and save it again with ``loader.samples_consumed`` 0, the epoch's position lost).

The kills are placed, not drawn: after the step that follows a save (``DTRAIN_FAULT_INJECT``), in
the middle of an interval whose restart resumes at an epoch boundary, and in the final
evaluation, after the final save (``task`` below, with ``marker``: the first process to evaluate
SIGKILLs itself, once per run)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.tasks import Task, load_task
from tests.paths import ROOT
from tests.support import faults, run_ckpt, run_cli

pytestmark = pytest.mark.slow

SPEC = "tests.multiprocess.train.test_restart_position:task"
# 12 steps per epoch on 2 processes of batch 16: synthetic's 384 samples end at the epoch's end,
# lm's 390 windows of 32 bytes leave 6 that drop_last skips (checkpoint 12 is then (epoch 0, 384)).
# 20 steps, a save every 4: checkpoint 12 ends epoch 0 and 20 is the final one.
TASKS = {
    "synthetic": (["base=synthetic", "shape=16", "samples=384", "hidden=16"], {"epoch": 1, "samples_consumed": 0}),
    "lm": (["base=lm", "layers=1", "heads=2", "width=32", "context=32", "max_bytes=13158"], {"epoch": 0, "samples_consumed": 384}),
}
STEPS, EVERY = 20, 4


def task(base: str = "synthetic", marker: str = "", data_dir: str | None = None, **options: str) -> Task:
    """The built-in task ``base``; with ``marker``, the first process of the run to score the test
    set (after the final checkpoint) dies by SIGKILL, as a worker lost at that moment would."""
    inner = load_task(base, data_dir=data_dir, options=options)
    if not marker:
        return inner

    def metric_or_die(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # killed once already: this is a restart
            return inner.metric(out, y)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    return dataclasses.replace(inner, metric=metric_or_die)


def _train(folder: Path, name: str, *, fault: str | None = None, marker: Path | None = None) -> str:
    args = [f"--task-arg={a}" for a in TASKS[name][0]] + ([f"--task-arg=marker={marker}"] if marker else [])
    r = run_cli(["train", "--task", SPEC, *args, "-n", "2", "--batch-size", "16", "--epochs", "2", "--max-steps", str(STEPS),
                 "--save-every", str(EVERY), "--keep", "100", "--seed", "3", "--max-restarts", "3",
                 "--checkpoint-dir", str(folder)],
                cwd=str(ROOT), timeout=400, env=faults.env(*map(int, fault.split(":"))) if fault else None)
    assert r.returncode == 0, f"{name}, fault {fault}, marker {marker}:\n{r.stderr[-3000:]}"
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == STEPS
    return r.stderr


def _positions(folder: Path) -> dict[int, dict[str, Any]]:
    """The loader state of every checkpoint in ``folder``, by step."""
    return {int(p.name.split("-")[1]): torch.load(p / "state.pt", weights_only=True)["objects"]["loader"]
            for p in sorted(folder.glob("step-*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """Each task's uninterrupted run's checkpoint folder."""
    out = {}
    for name, (_, end_of_epoch) in TASKS.items():
        folder = out[name] = tmp_path_factory.mktemp(f"reference-{name}")
        _train(folder, name)
        positions = _positions(folder)
        assert sorted(positions) == list(range(EVERY, STEPS + 1, EVERY))
        assert positions[12] == {**end_of_epoch, "seed": 3}, positions
        assert positions[20] == {"epoch": 1, "samples_consumed": 8 * 32, "seed": 3}, positions
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, fault, resumed", [
    ("synthetic", "1:9", [8, STEPS]),  # right after the save at 8, then in the final evaluation: resumes at 8, then at 20
    ("synthetic", "0:14", [12, STEPS]),  # mid-interval after the epoch's last step: resumes at 12, then at 20
    ("lm", "0:14", [12, STEPS]),  # the same, where drop_last left the epoch's last 6 windows out
])
def test_every_checkpoint_of_a_restarted_run_has_the_uninterrupted_data_position(tmp_path, reference, name, fault, resumed):
    folder = tmp_path / "ckpt"
    err = _train(folder, name, fault=fault, marker=tmp_path / "killed-in-evaluation")
    for restart, step in enumerate(resumed, start=1):
        line = f"resumed from {folder / f'step-{step:08d}'} at step {step} (saved by 2 process(es); elastic restart {restart}"
        assert line in err, err[-3000:]
    assert _positions(folder) == _positions(reference[name])
    code, out = run_ckpt("diff", reference[name], folder)  # the final one, every entry (weights, RNG, ...)
    assert code == 0 and "identical" in out, out[-3000:]
