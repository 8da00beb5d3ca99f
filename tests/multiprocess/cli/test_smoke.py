"""The smoke set (marker ``smoke``): a few fast end-to-end runs that CI also runs on the oldest
torch dtrain claims (``.ci/run``), so the claimed range is tested, not assumed: DDP on gloo,
FSDP, a compiled lm, a checkpoint resumed, the doctor. No torchvision (the CPU build of the
oldest torch has no matching torchvision on the index)."""

from __future__ import annotations

import json

import pytest

from tests.support import run_cli

pytestmark = pytest.mark.smoke


def _result(r) -> dict:
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train(strategy):
    res = _result(run_cli(["train", "--task", "synthetic", "-n", "2", "--strategy", strategy, "--max-steps", "6",
                           "--log-every", "3"], timeout=240))
    assert (res["world_size"], res["strategy"], res["steps"]) == (2, strategy, 6)
    assert res["samples_per_s"] > 0 and res["warmup_s"] is not None


def test_a_compiled_lm_trains():
    res = _result(run_cli(["train", "--task", "lm", "--compile", "--max-steps", "4", "--log-every", "2", "--task-arg", "layers=1",
                           "--task-arg", "width=32", "--task-arg", "context=32", "--batch-size", "4",
                           "--task-arg", "max_bytes=200000"], timeout=400))
    assert res["steps"] == 4 and res["train_loss"] > 0


def test_a_checkpoint_resumes(tmp_path):
    args = ["train", "--task", "synthetic", "--checkpoint-dir", str(tmp_path), "--log-every", "2"]
    first = _result(run_cli([*args, "--max-steps", "4"], timeout=180))
    second = _result(run_cli([*args, "--max-steps", "8", "--resume"], timeout=180))
    assert (first["steps"], second["steps"]) == (4, 8)
    assert (tmp_path / "latest").read_text().strip() == "step-00000008"


def test_the_doctor_passes():
    r = run_cli(["doctor"], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout
