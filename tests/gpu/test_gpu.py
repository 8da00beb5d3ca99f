"""The GPU tier (marker ``gpu``; ``pytest -m gpu`` selects it, tests/conftest.py skips it without
CUDA): training on CUDA with NCCL, bf16 and fp16 with a loss scaler, the CUDA-event step breakdown,
compile, fsdp on one GPU, the checks of ranks against GPUs and synthetic data on the device.
Their CPU counterparts (faked device counts, a slow first step, a stand-in CUDA device) are in
test_devices.py, test_throughput.py and test_fastpath.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import run_cli, run_distributed

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _train(*argv: str, timeout: float = 600) -> dict:
    r = run_cli(["train", "--device", "cuda", *argv], timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _two_gpus() -> None:
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {_gpus()}")


def _nccl_collectives() -> dict:
    """One rank per GPU: join an NCCL group (the harness sets RANK, WORLD_SIZE, LOCAL_RANK), then all-reduce,
    all-gather and reduce-scatter. A one-rank NCCL group still runs each collective's kernels."""
    import os

    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        t = torch.full((1024,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        gathered = torch.empty(n * 4, device="cuda")
        dist.all_gather_into_tensor(gathered, torch.arange(4, device="cuda", dtype=torch.float32) + 10 * rank)
        scattered = torch.empty(3, device="cuda", dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(scattered, torch.ones(3 * n, device="cuda", dtype=torch.bfloat16) * (rank + 1))
        torch.cuda.synchronize()
        return {"all_reduce": t.sum().item(), "all_gather": gathered.tolist(), "reduce_scatter": scattered.float().tolist(),
                "backend": dist.get_backend()}
    finally:
        dist.destroy_process_group()


def test_nccl_collectives_on_every_gpu():
    n = _gpus()
    out = run_distributed(_nccl_collectives, world_size=n, timeout=120)
    total = n * (n + 1) / 2  # ranks 1..n
    for r in out:
        assert r["backend"] == "nccl"
        assert r["all_reduce"] == 1024 * total
        assert r["all_gather"] == [float(x + 10 * k) for k in range(n) for x in range(4)]
        assert r["reduce_scatter"] == [total] * 3


def test_ddp_over_nccl_on_one_gpu():
    """DDP's gradient all-reduce through a one-rank NCCL group: the lm learns (loss well under ln 256 = 5.55)."""
    res = _train("--task", "lm", "--strategy", "ddp", "-n", "1", "--max-steps", "60", "--log-every", "20",
                 "--task-arg", "max_bytes=2000000", timeout=300)
    assert res["world_size"] == 1 and res["strategy"] == "ddp" and res["steps"] == 60
    assert res["samples_per_s"] > 0 and res["warmup_s"] is not None
    assert res["train_loss"] < 4.0, res["train_loss"]


def test_train_on_two_gpus_with_nccl():
    _two_gpus()
    res = _train("--task", "synthetic", "-n", "2", "--max-steps", "20", "--log-every", "10", timeout=300)
    assert res["world_size"] == 2 and res["steps"] == 20 and res["samples_per_s"] > 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_trains(precision):
    res = _train("--task", "lm", "--precision", precision, "--max-steps", "60", "--log-every", "20",
                 "--task-arg", "max_bytes=2000000")
    assert res["precision"] == precision
    # finite (fp16's scaler skipped what overflowed) and learning: ln 256 = 5.55 at the start
    assert res["train_loss"] == res["train_loss"] and res["train_loss"] < 4.0, res["train_loss"]


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

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).cuda()
    plain = torch.nn.Linear(8, 2).cuda()
    plain.load_state_dict(model.state_dict())
    before = model.weight.detach().clone()
    opt = make_optimizer("adamw", model.parameters(), 1e-2, device=torch.device("cuda"))
    ref = torch.optim.AdamW(plain.parameters(), 1e-2, foreach=False)
    assert opt.defaults["fused"] is True
    x = torch.randn(4, 8, device="cuda")
    for m, o in ((model, opt), (plain, ref)):
        m(x).sum().backward()
        o.step()
    assert (model.weight - before).abs().max().item() > 1e-3  # it stepped
    torch.testing.assert_close(model.weight, plain.weight, rtol=1e-5, atol=1e-6)  # as the unfused AdamW


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
