"""Ranks against GPUs, checked before any process starts (issue 28, item 1), on a CPU machine:
the GPU count is faked (``DTRAIN_FAKE_GPUS`` for a command, monkeypatching
``dtrain.launch.preflight.cuda_device_count`` in this process)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from dtrain.bench.methods import METHODS
from dtrain.bench.runner import _last_error
from dtrain.cli import doctor_checks as doctor
from dtrain.cli import doctor_probe
from tests.support import run_cli


@pytest.mark.parametrize("argv", [
    ["train", "--task", "synthetic", "-n", "2", "--max-steps", "1"],
    ["bench", "--task", "synthetic", "-n", "2", "--methods", "ddp", "--steps", "1"],
])
def test_commands_refuse_before_any_process_starts(argv, tmp_path):
    t0 = time.monotonic()
    r = run_cli([*argv, *(["--out", str(tmp_path)] if argv[0] == "bench" else [])], env={"DTRAIN_FAKE_GPUS": "1"}, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("dtrain: error: -n 2 starts 2 processes"), r.stderr
    assert "use -n 1, or --device cpu" in lines[0]
    assert "Traceback" not in r.stderr and "rendezvous" not in r.stderr
    assert time.monotonic() - t0 < 100  # no rendezvous timeout: nothing was started


def test_run_refuses_with_the_cpu_fix_for_scripts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    r = run_cli(["run", "-n", "3", str(script)], env={"DTRAIN_FAKE_GPUS": "2"}, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "a worker started" not in r.stdout + r.stderr
    assert re.search(r"dtrain: error: -n 3 starts 3 processes .* 2 usable GPU\(s\).*use -n 2, or CUDA_VISIBLE_DEVICES=", r.stderr)


def test_a_bench_failure_shows_the_workers_exception_not_torchruns_summary():
    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "reference.py", line 40, in main',
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, Duplicate GPU detected",
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "reference.py FAILED",
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ])
    proc = subprocess.CompletedProcess([], 1, stdout="", stderr=stderr)
    assert _last_error(proc).startswith("torch.distributed.DistBackendError: NCCL error in")


def test_a_failed_reference_rank_reaches_the_report_with_its_cause(tmp_path):
    # A real torchrun start of the plain reference whose task fails in the worker.
    from dtrain.bench.runner import BenchConfig, command

    cfg = BenchConfig(task="synthetic", task_args=("shape=0x1",), out=str(tmp_path), nproc=1)
    proc = subprocess.run(command(cfg, METHODS["reference"], 1, str(tmp_path / "r")), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "shape '0x1' is not like 1x28x28" in _last_error(proc), proc.stderr[-2000:]


@pytest.mark.smoke
def test_a_doctor_fail_line_carries_the_ranks_exception(monkeypatch):
    # Each probe rank asks for a GPU this machine does not have: the FAIL line says so.
    monkeypatch.setattr(doctor_probe, "local_probe_size", lambda gpus: (2, "cuda:7", ""))
    check = doctor_probe.check_allreduce(doctor.DoctorConfig())
    assert check.status == "FAIL"
    assert re.search(r"could not all-reduce \(rank 0: (dtrain\.errors\.)?ConfigError: device 'cuda:7' requested but CUDA is not available", check.detail), check.detail
