"""FSDP's mixed-precision policy (``dtrain.parallel.fsdp.mixed_precision``) on 2 gloo ranks:
under bf16-mixed, fsdp trains as ddp under autocast does (lm and images), its all-gathers move half
the bytes of fp32's, the optimizer steps fp32 shards, the forward runs without autocast, and an
fp16 overflow on one rank's shard skips the step on every rank."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import dtrain
from dtrain.precision import Precision
from dtrain.tasks import load_task
from tests.support import run_distributed

LM = ("lm", {"layers": "2", "heads": "4", "width": "32", "context": "16", "max_bytes": "40000"})
IMAGES = ("images", {"model": "resnet18", "source": "synthetic", "size": "16", "classes": "10", "samples": "32"})
STEPS = 3
# bf16-mixed under fsdp's policy against ddp's autocast: the same bf16 matmuls, but the policy
# also runs layer norms and the residual adds in bf16 (autocast keeps some in fp32). Measured
# after 3 steps on the lm: losses 7.5e-4 apart, weights 6.8e-4; the images task (convolutions
# and fp32 BatchNorm both ways): equal. A missing gradient average or a wrong reduce moves the
# weights by > 1e-2 (lr 0.1).
TOL = 5e-3


@contextlib.contextmanager
def counted() -> Any:
    """Bytes FSDP2 all-gathers (the gathered tensors) and reduce-scatters (the inputs), with their
    dtypes: torch 2.14's FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``."""
    seen: dict[str, Any] = {"gather": 0, "scatter": 0, "gather_dtypes": set(), "scatter_dtypes": set()}
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output_tensor, input_tensor, *args, **kwargs):  # noqa: ANN001, ANN202
        seen["gather"] += output_tensor.numel() * output_tensor.element_size()
        seen["gather_dtypes"].add(str(output_tensor.dtype))
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):  # noqa: A002, ANN001, ANN202
        seen["scatter"] += input.numel() * input.element_size()
        seen["scatter_dtypes"].add(str(input.dtype))
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        yield seen
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def _run(task_spec: tuple[str, dict], strategy: str, precision: str, **options: Any) -> dict:
    name, opts = task_spec
    task = load_task(name, options=opts)
    ctx = dtrain.init(strategy, precision=precision, seed=0, **options)  # the group is the first context's
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt, blocks=task.blocks(model) if task.blocks else None)
    autocast_on: list[bool] = []
    first = next(m for m in ctx.unwrap(model).modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    first.register_forward_hook(lambda *_: autocast_on.append(torch.is_autocast_enabled("cpu")))
    it = iter(ctx.setup_dataloader(DataLoader(task.train_set, batch_size=4, shuffle=True)))
    losses = []
    with counted() as seen:
        for _ in range(STEPS):
            x, y = next(it)
            loss = ctx.forward_backward(model, x, y, task.loss_fn)
            opt.step()
            opt.zero_grad()
            losses.append(ctx.all_reduce(loss.float().clone(), op="mean").item())
    own = ctx.unwrap(model)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone() for k, v in own.state_dict().items()}
    exp_avg = [s for s in opt.state.values()]
    out = {"losses": losses, "state": state, "gather": seen["gather"], "scatter": seen["scatter"],
           "gather_dtypes": sorted(seen["gather_dtypes"]), "scatter_dtypes": sorted(seen["scatter_dtypes"]),
           "param_dtypes": sorted({str(p.dtype) for p in own.parameters()}), "autocast": sorted(set(autocast_on)),
           "optimizer_state": len(exp_avg), "payload": ctx.strategy.comm_payload_bytes(own),
           "params": sum(p.numel() for p in own.parameters()),
           "norm_params": sum(p.numel() for m in own.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters())}
    ctx.close()
    return out


def _sides(task_spec: tuple[str, dict]) -> dict:
    """ddp under bf16 autocast, fsdp under bf16's policy, fsdp in fp32 and fsdp with bf16 gradients."""
    return {"ddp": _run(task_spec, "ddp", "bf16-mixed"), "fsdp": _run(task_spec, "fsdp", "bf16-mixed"),
            "fsdp32": _run(task_spec, "fsdp", "fp32"),
            "fsdp-bf16-reduce": _run(task_spec, "fsdp", "bf16-mixed", reduce_dtype="bf16")}


def _every_run() -> dict:
    """Every run of this file's tests in one process group (starting processes is the slow part on 2 cores)."""
    ctx = dtrain.init("ddp", seed=0)  # holds the group for the runs below
    try:
        return {"lm": _sides(LM), "images": _sides(IMAGES), "fp16-overflow": _fp16_overflow_on_one_rank()}
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_every_run, world_size=2, timeout=560)


def _assert_parity(got: dict, ref: dict) -> None:
    assert all(abs(a - b) <= TOL for a, b in zip(got["losses"], ref["losses"], strict=True)), (got["losses"], ref["losses"])
    assert all(math.isfinite(v) for v in got["losses"])
    for k in ref["state"]:
        diff = (got["state"][k] - ref["state"][k]).abs().max().item()
        assert diff <= TOL, f"{k}: max |diff| {diff:.3g} > {TOL}"


@pytest.mark.timeout(600)
def test_lm_fsdp_bf16_policy_matches_ddp_and_gathers_half_the_bytes(runs):
    for side in (rank["lm"] for rank in runs):
        ddp, fsdp, fp32, reduce16 = side["ddp"], side["fsdp"], side["fsdp32"], side["fsdp-bf16-reduce"]
        _assert_parity(fsdp, ddp)
        assert ddp["autocast"] == [True] and fsdp["autocast"] == [False]  # the policy casts; autocast is off
        assert fsdp["param_dtypes"] == ["torch.float32"]  # the optimizer steps fp32 shards (master weights)
        assert fsdp["gather_dtypes"] == ["torch.bfloat16"] and fsdp["scatter_dtypes"] == ["torch.float32"]
        assert fp32["gather_dtypes"] == ["torch.float32"]
        assert fsdp["gather"] * 2 == fp32["gather"] > 0  # half the all-gathered bytes per step
        assert fsdp["scatter"] == fp32["scatter"] > 0  # gradients still reduced in fp32
        assert reduce16["scatter_dtypes"] == ["torch.bfloat16"] and reduce16["scatter"] * 2 == fp32["scatter"]
        # the record's figure per step: 2 gathers (forward, backward) at 2 bytes, a reduce-scatter at 4
        assert fsdp["payload"] == fsdp["params"] * (2 * 2 + 4) and fp32["payload"] == fp32["params"] * (2 * 4 + 4)
        assert fsdp["gather"] <= STEPS * 2 * 2 * fsdp["params"] * 1.01  # the counted bytes are those (+ padding)


@pytest.mark.timeout(600)
def test_images_fsdp_bf16_policy_matches_ddp_with_batchnorm_kept_fp32(runs):
    for side in (rank["images"] for rank in runs):
        ddp, fsdp, fp32 = side["ddp"], side["fsdp"], side["fsdp32"]
        _assert_parity(fsdp, ddp)
        assert fsdp["autocast"] == [False] and fsdp["param_dtypes"] == ["torch.float32"]
        # BatchNorm's own units gather fp32 (its fp32 statistics need fp32 weights): the rest bf16
        assert fsdp["gather_dtypes"] == ["torch.bfloat16", "torch.float32"]
        share = fsdp["norm_params"] / fsdp["params"]
        assert fsdp["gather"] / fp32["gather"] == pytest.approx(0.5 + share / 2, rel=1e-3)


def _fp16_overflow_on_one_rank() -> dict:
    """fp16 with loss scaling (a CUDA preset, built here for the CPU): an inf in rank 0's shard of
    one gradient must skip the step on both ranks."""
    precision = Precision(name="fp16-mixed", autocast_dtype=torch.float16, scale_loss=True, device_type="cpu")
    name, opts = LM
    task = load_task(name, options=opts)
    ctx = dtrain.init("fsdp", precision=precision, seed=0)
    try:
        torch.manual_seed(0)
        model = task.build_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ctx.setup(model, opt, blocks=task.blocks(model))
        x, y = next(iter(ctx.setup_dataloader(DataLoader(task.train_set, batch_size=4, shuffle=True))))
        ctx.forward_backward(model, x, y, task.loss_fn)
        params = [p for p in ctx.unwrap(model).parameters()]
        before = [p.full_tensor().clone() for p in params]
        if ctx.rank == 0:
            params[0].grad.to_local().view(-1)[0] = float("inf")
        scale = ctx.scaler.get_scale()
        opt.step()
        kept, after = all(torch.equal(p.full_tensor(), b) for p, b in zip(params, before)), ctx.scaler.get_scale()
        moved, loss = False, torch.tensor(float("nan"))
        for _ in range(8):  # the next steps step, once the scale has backed off below fp16's overflow
            opt.zero_grad()
            loss = ctx.forward_backward(model, x, y, task.loss_fn)
            opt.step()
            moved = not all(torch.equal(p.full_tensor(), b) for p, b in zip(params, before))
            if moved:
                break
        return {"scaler": type(ctx.scaler).__name__, "kept": kept, "scale": (scale, after),
                "gathered": str(params[0].dtype), "loss": loss.item(), "moved": moved}
    finally:
        ctx.close()


@pytest.mark.timeout(600)
def test_fp16_overflow_on_one_shard_skips_the_step_on_every_rank(runs):
    for r in (rank["fp16-overflow"] for rank in runs):
        # torch's own GradScaler: DTensor runs its inf check on each shard and all-reduces the flag
        # (one all-reduce, measured with CommDebugMode), so no ShardedGradScaler is needed.
        assert r["scaler"] == "GradScaler"
        assert r["kept"], r  # both ranks skipped: rank 1's shard had no inf of its own
        assert r["scale"][1] == r["scale"][0] / 2  # and both backed off alike
        assert r["moved"] and math.isfinite(r["loss"]) and r["gathered"] == "torch.float32"
