"""The `images` task on a small folder of real JPEG files (MNIST digits written as RGB JPEGs at
test time), its bad inputs, its synthetic source, exact resume with DataLoader workers, and the
data-wait figures of `dtrain train`."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.logic.tasks import test_images as logic_half
from tests.logic.tasks.test_images import SIZE
from tests.paths import ROOT
from tests.support import run_ckpt, run_cli

# The logic half's fixtures, shared: pytest finds a fixture by its name in the module.
broken, folder = logic_half.broken, logic_half.folder


def _train(args: list[str], timeout: float = 280) -> tuple[dict, str]:
    r = run_cli(["train", "--task", "images", *args], cwd=str(ROOT), timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.timeout(300)  # one process, ~10 s idle; minutes when other jobs load the machine
def test_the_summary_says_when_input_was_the_bottleneck():
    """16 samples of 50 ms each per step (0.8 s), a model that takes ~1 ms: the step waits for data."""
    r = run_cli(["train", "--task", "tests.user_task:make_slow", "--task-arg", "delay=0.05", "--strategy", "single",
                 "--max-steps", "4", "--num-workers", "0"], cwd=str(ROOT), timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["data_wait_share"] >= 0.1 and result["data_wait_ms"] >= 16 * 50 * 0.9, result  # 0.1: the warning's threshold
    assert "input was the bottleneck: waited for data" in r.stderr and "--num-workers" in r.stderr, r.stderr[-3000:]


def test_corrupt_image_names_the_file_in_one_line_from_a_worker(broken):
    pytest.importorskip("torchvision")
    data, bad = broken
    r = run_cli(["train", "--task", "images", "--data-dir", str(data), "--task-arg", f"size={SIZE}", "--batch-size", "50",
                 "--max-steps", "4", "--num-workers", "1"], cwd=str(ROOT), timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dtrain: error:")]
    assert len(lines) == 1 and f"cannot read image {bad}" in lines[0] and "skip_bad=true" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


# -- training ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resnet18_learns_on_two_ranks_and_reports_data_wait(folder, tmp_path):
    pytest.importorskip("torchvision")
    metrics = tmp_path / "m.jsonl"
    result, err = _train(["--data-dir", str(folder), "--task-arg", f"size={SIZE}", "-n", "2", "--batch-size", "16",
                          "--optimizer", "adam", "--lr", "0.001", "--max-steps", "48", "--log-every", "16",
                          "--metrics-file", str(metrics)])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # 48 steps (~4 epochs of 200 images): on torch 2.14.1, 24 steps left the loss at 2.28 and accuracy at chance.
    assert [r["step"] for r in records] == [16, 32, 48]
    assert records[-1]["train_loss"] < records[0]["train_loss"], records
    assert result["test_acc"] > 0.2, result  # 10 classes: chance is 0.1
    assert all(isinstance(r["data_wait_ms"], float) for r in records), records  # measured each window, never null
    assert f", {result['num_workers']} data worker(s)/process" in err, err  # the start line says the count the record has
    assert 0 <= result["data_wait_share"] < 1 and isinstance(result["data_wait_ms"], float) and result["images_skipped"] == 0, result


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_synthetic_source_runs_with_channels_last(tmp_path):
    pytest.importorskip("torchvision")
    result, err = _train(["--task-arg", "source=synthetic", "--task-arg", f"size={SIZE}", "--task-arg", "classes=10",
                          "--task-arg", "samples=64", "-n", "2", "--batch-size", "8", "--max-steps", "3", "--channels-last",
                          "--sync-bn"])
    assert result["steps"] == 3 and result["test_acc"] is None and result["num_workers"] == 0, result
    assert "BatchNorm statistics stay per rank" in err and err.count("--sync-bn") == 1, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)  # two 2-process runs (three took about 70 s on an idle 2-core machine); minutes on a busy one
def test_resume_mid_epoch_with_two_workers_is_bitwise_identical(folder, tmp_path):
    """12 steps per epoch (200 images, 2 ranks x 8); 8 steps that save at step 5 too, and a run
    resumed from (a copy of) that save to 8. With random crops and flips drawn in 2 workers per
    rank, ahead of the step being saved, the resumed run ends on the same weights. (A run stopped
    by --max-steps makes the same save: tests/multiprocess/checkpoint/test_resume.py.)"""
    pytest.importorskip("torchvision")
    common = ["--data-dir", str(folder), "--task-arg", f"size={SIZE}", "-n", "2", "--batch-size", "8", "--num-workers", "2", "--log-every", "4"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    _train([*common, "--max-steps", "8", "--save-every", "5", "--checkpoint-dir", str(whole)])
    shutil.copytree(whole / "step-00000005", part / "step-00000005")
    resumed, err = _train([*common, "--max-steps", "8", "--checkpoint-dir", str(part), "--resume"])
    assert "at step 5" in err and resumed["steps"] == 8, err[-3000:]
    code, out = run_ckpt("diff", whole, part)
    assert code == 0 and "identical" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sync_bn_under_pipeline_is_one_line(tmp_path):
    pytest.importorskip("torchvision")
    r = run_cli(["train", "--task", "images", "--task-arg", "source=synthetic", "--task-arg", f"size={SIZE}",
                 "--task-arg", "samples=64", "--strategy", "pipeline", "-n", "2", "--sync-bn", "--max-steps", "1"],
                cwd=str(ROOT), timeout=180)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dtrain: error:")]
    # Both ranks raise it; the launcher shows it once.
    assert r.returncode == 2 and len(lines) == 1 and "--sync-bn shares BatchNorm statistics" in lines[0], r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pipeline_cuts_resnet18_between_its_stages(tmp_path):
    pytest.importorskip("torchvision")
    result, err = _train(["--task-arg", "source=synthetic", "--task-arg", f"size={SIZE}", "--task-arg", "classes=4",
                          "--task-arg", "samples=64", "-n", "2", "--strategy", "pipeline", "--batch-size", "8", "--max-steps", "2",
                          "--activation-checkpointing"])
    assert result["steps"] == 2 and result["strategy"] == "pipeline" and result["train_loss"] > 0, result


def test_channels_last_under_fsdp_is_one_line_before_any_worker_starts():
    pytest.importorskip("torchvision")
    r = run_cli(["train", "--task", "images", "--task-arg", "source=synthetic", "--task-arg", f"size={SIZE}",
                 "--strategy", "fsdp", "-n", "2", "--channels-last", "--max-steps", "1"], cwd=str(ROOT), timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dtrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "--channels-last does not compose with 'fsdp'" in lines[0] and "use ddp, zero1 or hvd" in lines[0], lines
