"""Ranks against GPUs, checked before any process starts (issue 28, item 1), on a CPU machine:
the GPU count is faked (``DTRAIN_FAKE_GPUS`` for a command, monkeypatching
``dtrain.launch.preflight.cuda_device_count`` in this process)."""

from __future__ import annotations

import pytest

from dtrain.bench.fit import fit_methods
from dtrain.bench.methods import METHODS
from dtrain.cli import doctor_probe as doctor
from dtrain.errors import ConfigError
from dtrain.launch import preflight
from dtrain.launch.local import DistributedTestError, exception_line
from dtrain.launch.preflight import check_ranks_fit
from dtrain.options import TestHooks


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n: int) -> None:
        monkeypatch.setattr(preflight, "cuda_device_count", lambda: n)
    return set_count


def test_the_fake_count_is_read_from_one_variable():
    assert TestHooks.from_env({}).fake_gpus is None
    assert TestHooks.from_env({"DTRAIN_FAKE_GPUS": "3"}).fake_gpus == 3
    with pytest.raises(ConfigError, match="DTRAIN_FAKE_GPUS='x' is not a number"):
        TestHooks.from_env({"DTRAIN_FAKE_GPUS": "x"})


@pytest.mark.smoke
def test_more_ranks_than_gpus_is_one_line_with_both_fixes(gpus):
    gpus(1)
    with pytest.raises(ConfigError) as err:
        check_ranks_fit(2)
    text = str(err.value)
    assert "-n 2 starts 2 processes" in text and "1 usable GPU(s)" in text
    assert "use -n 1, or --device cpu" in text and "\n" not in text


def test_ranks_that_fit_or_train_on_the_cpu_pass(gpus):
    gpus(4)
    check_ranks_fit(4)
    check_ranks_fit(1, "cuda")
    gpus(1)
    check_ranks_fit(8, "cpu")  # gloo: any number of processes
    gpus(0)
    check_ranks_fit(8)  # no GPU: the ranks use the CPU


def test_one_named_gpu_holds_one_rank(gpus):
    gpus(8)
    with pytest.raises(ConfigError, match=r"one GPU \(cuda:0\) for all of them.*use -n 1"):
        check_ranks_fit(2, "cuda:0")


@pytest.mark.smoke
def test_bench_sizes_its_default_to_the_gpus_and_says_why():
    methods = [METHODS[n] for n in ("single", "ddp", "ddp-fp16", "pipeline")]
    fit = fit_methods(methods, 2, None, nproc_given=False, gpus=1)
    assert fit.nproc == 1
    assert fit.notes and "sized from the default 2 to 1" in fit.notes[0]
    assert [m.name for m in fit.methods] == ["single", "ddp", "ddp-fp16"]
    assert fit.skipped == [{"method": "pipeline", "why": "pipeline needs at least 2 processes (a stage each); this bench runs 1"}]
    with pytest.raises(ConfigError, match="use -n 1"):
        fit_methods(methods, 2, None, nproc_given=True, gpus=1)
    cpu = fit_methods(methods, 2, "cpu", nproc_given=True, gpus=1)
    assert cpu.nproc == 2 and [s["method"] for s in cpu.skipped] == ["ddp-fp16"]


def test_the_doctor_probe_uses_one_process_per_gpu_or_gloo():
    assert doctor.local_probe_size(0) == (2, "cpu", "")
    n, device, note = doctor.local_probe_size(1)
    assert (n, device) == (2, "cpu") and "1 GPU" in note and "gloo" in note
    assert doctor.local_probe_size(4) == (4, None, "")
    assert doctor.local_probe_size(16)[0] == doctor.PROBE_MAX_PROCS


def test_exception_line_and_first_cause():
    assert exception_line("Traceback (most recent call last):\n  File x\nValueError: bad\n") == "ValueError: bad"
    err = DistributedTestError("rank 1 raised:\n...", {1: "RuntimeError: boom", 0: "ValueError: first"})
    assert err.first_cause() == "rank 0: ValueError: first"


