"""The samples ledger (`dtrain train --ledger`, `dtrain ckpt ledger`): the rule that counts a redone
step once, a normal run, a run killed with -9 and resumed (also on another world size), a forged
duplicate."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from dtrain.data.ledger import check_ledger, render
from tests.paths import ROOT
from tests.support import faults, run_cli

TASK = "tests.user_task:make_dropout"  # 256 samples, batch 16, 2 epochs: 8 steps an epoch on 2 processes


def _ledger(folder: Path):
    r = run_cli(["ckpt", "ledger", str(folder)], timeout=60)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_normal_run_is_exactly_once_and_a_forged_duplicate_fails(tmp_path):
    led, log = tmp_path / "ledger", tmp_path / "served"
    log.mkdir()
    r = run_cli(["train", "--task", "tests.user_task:make_logged", "--task-arg", f"log_dir={log}", "-n", "2",
                 "--ledger", str(led)], cwd=str(ROOT), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    code, out = _ledger(led)
    assert code == 0 and out.count("exactly once") == 2, out
    # The ledger names the samples the data set actually served, no more, no less.
    served = collections.Counter(int(v) for f in log.iterdir() for v in f.read_text().split())
    recorded = collections.Counter(i for f in led.iterdir() for line in f.read_text().splitlines()
                                   if '"i"' in line for i in json.loads(line)["i"])
    assert served == recorded
    rank1 = led / "gen00001-rank00001.jsonl"
    step = json.loads(rank1.read_text().splitlines()[3])
    with open(rank1, "a") as f:  # a forged record: step 3's samples again, as epoch 0 of a step 99
        f.write(json.dumps({"s": 99, "e": step["e"], "i": step["i"]}) + "\n")
    code, out = _ledger(led)
    assert code == 1 and "FAIL: duplicated" in out, out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_9_under_max_restarts_then_resume_on_one_process_is_exactly_once(tmp_path):
    rank, step = random.randrange(2), random.randrange(1, 10)  # any draw must pass; printed on failure
    where = f"rank {rank} killed after step {step}"
    ck, led = tmp_path / "ck", tmp_path / "ledger"
    r = run_cli(["train", "--task", TASK, "-n", "2", "--checkpoint-dir", str(ck), "--save-every", "3", "--max-steps", "10",
                 "--max-restarts", "2", "--ledger", str(led)], cwd=str(ROOT), timeout=300,
                env=faults.env(rank, step))
    assert r.returncode == 0, f"{where}\n{r.stderr[-3000:]}"
    r = run_cli(["train", "--task", TASK, "-n", "1", "--checkpoint-dir", str(ck), "--resume", "--ledger", str(led)],
                cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, f"{where}\n{r.stderr[-3000:]}"
    report = check_ledger(str(led))
    assert report.ok and len(report.epochs) == 2 and all(e.complete for e in report.epochs), f"{where}\n{render(report)}"
    # The kill comes after step's ledger record and before its save: the steps after the last save are redone.
    assert report.steps_discarded == step - 3 * ((step - 1) // 3), f"{where}\n{render(report)}"
    assert report.generations == 3, f"{where}\n{render(report)}"
