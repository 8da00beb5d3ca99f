"""--micro-batch auto on 2 gloo ranks: only rank 1 runs out of memory (its fake device,
``DTRAIN_OOM_INJECT``), both ranks agree and train with the same smaller micro-batch, and the run
ends with the parameters of a run started at that micro-batch with the matching --grad-accum, each
sample of the epoch trained once (the ledger)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint.validate import read_checkpoint
from dtrain.data.ledger import check_ledger
from tests.support import run_cli, run_distributed

TASK = {"shape": "64", "hidden": "256", "samples": "512"}
"""85,002 parameters (680,016 bytes with their gradients); 8,452 + 2,088 bytes per sample saved for backward."""
BUDGET = 710_016
"""Rank 1's fake device: 8 samples per micro-step fit (705,172 bytes), 16 do not (721,876)."""


def _records(ledger: str) -> list[tuple[int, int, list[int]]]:
    out = []
    for path in sorted(Path(ledger).glob("gen*-rank*.jsonl")):
        out += [(rec["s"], rank, rec["i"]) for rank, rec in ((int(path.stem[-5:]), json.loads(line))
                                                             for line in path.read_text().splitlines()) if "s" in rec]
    return sorted(out)


def train_both(folder: str) -> dict:
    """The same job twice in one process group: with --micro-batch auto, then with --grad-accum 4."""
    from dtrain.train import TrainConfig, run
    from dtrain.train.config import BatchConfig, CheckpointConfig, ObserveConfig, ScheduleConfig, TaskConfig
    from dtrain.train.microbatch import AutoMicro
    from dtrain.world import World, destroy_process_group, init_process_group

    world = World.detect()
    init_process_group(world)
    out = {}
    try:
        for name, batch in (("auto", BatchConfig(size=32, micro=AutoMicro())), ("accum", BatchConfig(size=32, grad_accum=4))):
            cfg = TrainConfig(task=TaskConfig(name="synthetic", args=TASK), batch=batch, schedule=ScheduleConfig(epochs=1, seed=3),
                              checkpoint=CheckpointConfig(dir=f"{folder}/{name}-ckpt"),
                              observe=ObserveConfig(ledger=f"{folder}/{name}-ledger", log_every=100))
            out[name] = run(cfg, world=world)
    finally:
        destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_only_rank_1_runs_out_both_agree_and_train_as_the_matching_accumulation(tmp_path):
    ranks = run_distributed(train_both, str(tmp_path), world_size=2, timeout=280, env={"DTRAIN_OOM_INJECT": f"1:{BUDGET}"})
    for rank, got in enumerate(ranks):
        auto = got["auto"]
        assert (auto["micro_batch"], auto["grad_accum"]) == (8, 4), (rank, auto)
        assert auto["micro_batch_trials"] == [[32, False], [16, False], [8, True]], (rank, auto)
        assert "micro_batch" not in got["accum"] and auto["steps"] == got["accum"]["steps"] == 8
    final = {name: read_checkpoint(str(sorted((tmp_path / f"{name}-ckpt").glob("step-*"))[-1]))["objects"]["model"]
             for name in ("auto", "accum")}
    assert final["auto"].keys() == final["accum"].keys()
    for key, value in final["auto"].items():
        torch.testing.assert_close(value, final["accum"][key], rtol=1e-6, atol=1e-7, msg=key)
    report = check_ledger(str(tmp_path / "auto-ledger"))
    assert report.ok and [(e.seen, e.duplicated, e.missing, e.complete) for e in report.epochs] == [(512, 0, 0, True)]
    assert _records(str(tmp_path / "auto-ledger")) == _records(str(tmp_path / "accum-ledger"))  # the same samples, step by step


@pytest.mark.timeout(300)
def test_the_command_proposes_confirms_and_says_so(tmp_path):
    """The whole path: the plan's proposal in the launching process, the trials in the workers. The
    reserve for the optimizer state (SGD's momentum: 340,008 bytes) counts on the fake device too."""
    r = run_cli(["train", "-n", "2", "--task", "synthetic", *(f"--task-arg={k}={v}" for k, v in TASK.items()), "--batch-size", "32",
                 "--max-steps", "3", "--micro-batch", "auto", "--ledger", str(tmp_path / "ledger")],
                timeout=280, env={"DTRAIN_OOM_INJECT": f"1:{BUDGET + 340_008}"})
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if "--micro-batch auto" in ln)
    assert "8 sample(s) per micro-step x 4 accumulated = batch 32/process" in line, line
    assert "32 (out of memory on rank 1), 16 (out of memory on rank 1), 8 (fits)" in line and "proposed 32 by the plan" in line, line
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert (result["micro_batch"], result["grad_accum"], result["steps"]) == (8, 4, 3)
    assert check_ledger(str(tmp_path / "ledger")).steps_kept == 3


@pytest.mark.timeout(300)
def test_a_model_that_does_not_fit_one_sample_on_any_rank_is_one_line_before_training(tmp_path):
    r = run_cli(["train", "-n", "2", "--task", "synthetic", *(f"--task-arg={k}={v}" for k, v in TASK.items()),
                 "--batch-size", "32", "--max-steps", "3", "--micro-batch", "auto", "--ledger", str(tmp_path / "ledger")],
                timeout=280, env={"DTRAIN_OOM_INJECT": "1:1000"})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("dtrain: error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-3000:]
    assert "one sample per micro-step does not fit on cpu (out of memory on rank(s) 1)" in errors[0], errors
    assert not any('"s":' in p.read_text() for p in (tmp_path / "ledger").glob("gen*")), "a step was committed"


STEP_BUDGET = 1_070_000
"""Rank 1's fake device for its training steps from step 3 on (``@3``): parameters, gradients and
SGD's momentum (1,020,024 bytes) with 16 samples' activations fit (1,061,884), 32 do not (1,095,292)."""


def retried_and_reference(folder: str) -> dict:
    """--micro-batch auto whose step 3 runs out of memory on rank 1, then the reference: 3 steps of
    the whole batch, resumed from their checkpoint with --grad-accum 2 (16 per micro-step) to the end."""
    from dtrain.train import TrainConfig, run
    from dtrain.train.config import BatchConfig, CheckpointConfig, ObserveConfig, ScheduleConfig, TaskConfig
    from dtrain.train.microbatch import AutoMicro
    from dtrain.world import World, destroy_process_group, init_process_group

    world = World.detect()
    init_process_group(world)
    out = {}
    runs = (("auto", BatchConfig(size=32, micro=AutoMicro()), None, False),
            ("ref", BatchConfig(size=32), 3, False), ("ref", BatchConfig(size=32, grad_accum=2), None, True))
    try:
        for i, (name, batch, steps, resume) in enumerate(runs):
            cfg = TrainConfig(task=TaskConfig(name="synthetic", args=TASK), batch=batch,
                              schedule=ScheduleConfig(epochs=1, seed=3, max_steps=steps),
                              checkpoint=CheckpointConfig(dir=f"{folder}/{name}-ckpt", resume=resume),
                              observe=ObserveConfig(ledger=f"{folder}/{name}-ledger", log_every=100))
            out[f"{name}{i}"] = run(cfg, world=world)
    finally:
        destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_a_later_steps_out_of_memory_on_one_rank_is_retried_smaller_and_trains_as_the_smaller_micro_batch(tmp_path):
    ranks = run_distributed(retried_and_reference, str(tmp_path), world_size=2, timeout=280,
                            env={"DTRAIN_OOM_INJECT": f"1:{STEP_BUDGET}@3"})
    for rank, got in enumerate(ranks):
        auto = got["auto0"]
        assert auto["micro_batch_trials"] == [[32, True]], (rank, auto)  # the trials had no fake device
        assert (auto["micro_batch"], auto["grad_accum"], auto["micro_batch_retries"]) == (16, 2, [[3, 32, 16]]), (rank, auto)
        assert auto["steps"] == 8 and got["ref1"]["steps"] == 3 and got["ref2"]["steps"] == 8
    final = {name: read_checkpoint(str(sorted((tmp_path / f"{name}-ckpt").glob("step-*"))[-1]))["objects"]["model"]
             for name in ("auto", "ref")}
    for key, value in final["auto"].items():
        torch.testing.assert_close(value, final["ref"][key], rtol=1e-6, atol=1e-7, msg=key)
    report = check_ledger(str(tmp_path / "auto-ledger"))
    assert report.ok and [(e.seen, e.duplicated, e.missing, e.complete) for e in report.epochs] == [(512, 0, 0, True)]
    assert report.steps_kept == 8
