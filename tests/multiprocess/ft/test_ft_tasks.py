"""The lm and images tasks under ``dtrain train --fault-tolerance``: 2 replica groups (min=2, so both
step together from the first step) end at the same step with the same model, bit for bit, BatchNorm's
running statistics included (resnet18: the groups average them with the gradients), and the ledger
holds every step's samples once."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.ft.ledger import check_ft_ledger
from tests.support import run_cli

from .test_fault_tolerance import _model_state

pytest.importorskip("torchft")

TASKS = {
    "lm": ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "heads=4", "--task-arg", "width=32",
           "--task-arg", "context=16", "--task-arg", "max_bytes=40000", "--max-steps", "12"],
    "images": ["--task", "images", "--task-arg", "source=synthetic", "--task-arg", "size=16", "--task-arg", "model=resnet18",
               "--task-arg", "classes=10", "--task-arg", "samples=64", "--batch-size", "8", "--max-steps", "6"],
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_task_trains_on_two_replica_groups_that_stay_equal(task, tmp_path):
    r = run_cli(["train", "--fault-tolerance", "min=2,heartbeat=1", "--nproc", "2", *TASKS[task],
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--ledger", str(tmp_path / "ledger")], timeout=360)
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 and results[0]["steps"] == results[1]["steps"] > 0
    assert all(x["fault_tolerance"]["participants_min"] == 2 for x in results)
    (_, a), (_, b) = (_model_state(str(tmp_path / "ckpt" / f"replica-0-{i}")) for i in (0, 1))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert disagree == [] and report.ok and report.steps_kept == results[0]["steps"]
