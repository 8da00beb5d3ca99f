"""The GPU tier (marker ``gpu``; ``pytest -m gpu`` selects it, tests/conftest.py skips it without
CUDA): training on CUDA with NCCL, bf16 and fp16 with a loss scaler, the CUDA-event step breakdown,
compile, fsdp on one GPU, the checks of ranks against GPUs and synthetic data on the device.
Their CPU counterparts (faked device counts, a slow first step, a stand-in CUDA device) are in
test_devices.py, test_throughput.py and test_fastpath.py."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.testing import run_cli, run_distributed

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _train(*argv: str, timeout: float = 600) -> dict:
    r = run_cli(["train", "--device", "cuda", *argv], timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _nccl_all_reduce() -> float:
    """One rank per GPU: join an NCCL group (the harness sets RANK, WORLD_SIZE, LOCAL_RANK) and all-reduce."""
    import os

    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    return t[0].item()


def test_nccl_all_reduces_on_every_gpu():
    n = _gpus()
    assert run_distributed(_nccl_all_reduce, world_size=n, timeout=120) == [float(n)] * n


def test_train_on_cuda_with_nccl():
    n = min(2, _gpus())
    res = _train("--task", "synthetic", "-n", str(n), "--max-steps", "20", "--log-every", "10", timeout=300)
    assert res["world_size"] == n and res["steps"] == 20
    assert res["samples_per_s"] > 0 and res["warmup_s"] is not None


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_trains(precision):
    res = _train("--task", "synthetic", "--precision", precision, "--max-steps", "30", "--log-every", "10")
    assert res["precision"] == precision
    assert res["train_loss"] == res["train_loss"]  # not NaN: fp16's scaler skipped what overflowed


def test_the_breakdown_uses_cuda_events():
    res = _train("--task", "synthetic", "--max-steps", "20", "--log-every", "10")
    ms = res["breakdown"][0]["median_ms"]
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["step"] >= ms["forward"]


def test_compile_reports_warmup_apart_and_a_steady_rate():
    res = _train("--task", "lm", "--compile", "--max-steps", "40", "--log-every", "10", "--precision", "bf16-mixed")
    assert res["warmup_s"] > 0 and res["tokens_per_s"] > 0
    assert res["mfu"] is None or 0 < res["mfu"] < 1


def test_fast_path_on_the_lm():
    res = _train("--task", "lm", "--fast", "--max-steps", "30", "--log-every", "10")
    assert res["precision"] == ("bf16-mixed" if torch.cuda.is_bf16_supported() else "fp32")


def test_fused_optimizer_steps_on_cuda():
    from dtrain.tasks import make_optimizer

    model = torch.nn.Linear(8, 2).cuda()
    opt = make_optimizer("adamw", model.parameters(), 1e-3, device=torch.device("cuda"))
    assert opt.defaults["fused"] is True
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()


def test_fsdp_on_one_gpu():
    res = _train("--task", "lm", "--strategy", "fsdp", "--max-steps", "10", "--log-every", "5")
    assert res["strategy"] == "fsdp" and res["steps"] == 10


def test_more_ranks_than_gpus_is_refused_before_start():
    n = _gpus() + 1
    r = run_cli(["train", "--task", "synthetic", "-n", str(n), "--max-steps", "1"], timeout=120)
    assert r.returncode == 2
    assert f"-n {n} starts {n} processes" in r.stderr and f"use -n {n - 1}, or --device cpu" in r.stderr


def test_the_doctor_passes_on_this_gpu_machine():
    r = run_cli(["doctor"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout


def test_synthetic_images_stay_on_the_device():
    pytest.importorskip("torchvision")
    res = _train("--task", "images", "--task-arg", "source=synthetic", "--task-arg", "model=resnet18", "--task-arg", "size=64",
                 "--batch-size", "64", "--max-steps", "30", "--log-every", "10", "--precision", "bf16-mixed")
    assert res["num_workers"] == 0
    assert res["data_wait_share"] < 0.05, res  # the batch is made once on the GPU
