"""The command line as a user meets it: launchers, the ready job and the examples. Its bad inputs end
before any process starts: tests/logic/cli/test_cli.py runs them in-process."""

from __future__ import annotations

import json

import pytest

from tests.paths import ROOT, TESTS
from tests.support import run_cli

SCRIPT = str(TESTS / "scripts" / "allreduce.py")


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_run_starts_two_processes(launcher):
    r = run_cli(["run", "-n", "2", "--launcher", launcher, SCRIPT, "--flag", "x"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "world=2 sum=3 argv=['--flag', 'x']" in r.stdout


def test_train_digits_two_processes_prints_summary_and_json_last(tmp_path):
    metrics = tmp_path / "m.jsonl"
    ckpt = tmp_path / "ckpt"
    r = run_cli(["train", "-n", "2", "--epochs", "2", "--log-every", "5", "--metrics-file", str(metrics),
                 "--checkpoint-dir", str(ckpt)], timeout=180)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "params" in r.stdout and "total" in r.stdout  # model summary table
    result = json.loads(lines[-1])
    assert set(result) == {"task", "world_size", "strategy", "precision", "steps", "samples_per_s", "train_loss", "test_acc",
                           "wall_s", "comm", "comm_choice", "data_wait_ms", "data_wait_share", "data_first_wait_ms", "num_workers",
                           "breakdown", "stragglers", "flops_per_sample", "achieved_tflops", "mfu", "warmup_s", "warmup_steps"}
    assert result["num_workers"] == 0 and isinstance(result["data_wait_ms"], float)  # digits is in memory: no workers by default
    assert (result["task"], result["world_size"], result["strategy"], result["steps"]) == ("digits", 2, "ddp", 44)
    assert (result["comm"], result["comm_choice"]) == ("none", "none")  # the ddp strategy says how gradients travelled
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in records] == [5, 10, 15, 20, 25, 30, 35, 40, 44]
    assert (ckpt / "latest").read_text().strip() == "step-00000044"


def test_user_task_runs(tmp_path):
    r = run_cli(["train", "--task", "tests.user_task:make", "--task-arg", "hidden=32"], timeout=120,
                cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["test_acc"] > 0.8


@pytest.mark.slow
def test_mnist_300_steps_of_32_samples_a_process_on_two_processes_reaches_97_percent(mnist_dir):
    # 300 steps of 32 samples a process (19,200 samples, 40% of the epoch) reach 97.6% (250: 97.1%;
    # torch 2.14.1, 2 CPU processes), where a broken input path, loss or optimizer ends far below
    # (Adadelta's lr 0.1 for 1.0 fails it). The task's own batch of 64 needed 250 steps (32,000
    # samples: 97.7%) for the same margin: 81 CPU-seconds of the test rather than 62.
    r = run_cli(["train", "--task", "mnist", "--data-dir", str(mnist_dir), "-n", "2", "--batch-size", "32", "--max-steps", "300"],
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["test_acc"] >= 0.97, result
    assert result["steps"] == 300 and result["world_size"] == 2


#: Run by tests/multiprocess/compat/test_compat.py with the same command (apex_style.py: its default
#: --opt-level O1, plus --checkpoint) and its accuracy checked: not twice.
RUN_ELSEWHERE = {"apex_style.py", "horovod_style.py"}


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name not in RUN_ELSEWHERE))
def test_examples_run_on_two_processes(example, tmp_path):
    path = ROOT / "examples" / example
    args = [str(tmp_path / "ckpt")] if example == "checkpoint_resume.py" else []  # its one required argument
    r = run_cli(["run", "-n", "2", str(path), *args], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
