"""Horovod- and apex-shaped APIs, and the hvd/dp strategies, against DDP."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import dtrain
from tests.multiprocess.strategies.test_ddp import _data, _model  # the same small regression problem
from tests.support import run_distributed

STEPS = 6


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ctx_steps(strategy: str, accum: int, batch: int = 8) -> dict[str, torch.Tensor]:
    """``STEPS`` optimizer steps through the Context API with ``strategy``."""
    ctx = dtrain.init(strategy, seed=0)
    model = _model()
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    it = iter(ctx.setup_dataloader(DataLoader(_data(), batch_size=batch * accum, shuffle=True)))
    for _ in range(STEPS):
        x, y = next(it)
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with ctx.accumulate(model, steps=accum):
                ctx.backward(torch.nn.functional.mse_loss(model(xm), ym))
                opt.step()
                opt.zero_grad()
    out = _state(model)
    ctx.close()
    return out


def horovod_steps(bpps: int, compression: str = "none", batch: int = 8) -> dict[str, torch.Tensor]:
    """The same training written as a Horovod script would write it."""
    import dtrain.compat.horovod as hvd

    hvd.init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=bpps,
        compression=getattr(hvd.Compression, compression),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # The same shard and order as ctx.setup_dataloader gives (seed 0, this rank, this size).
    ctx_loader = dtrain.data.loader.reshard(
        DataLoader(_data(), batch_size=batch * bpps, shuffle=True), rank=hvd.rank(), world_size=hvd.size(), seed=0, shuffle=True
    )
    it = iter(ctx_loader)
    for _ in range(STEPS):
        x, y = next(it)
        for xm, ym in zip(x.chunk(bpps), y.chunk(bpps)):
            (torch.nn.functional.mse_loss(model(xm), ym) / bpps).backward()
        opt.step()
        opt.zero_grad()
    out = _state(model)
    hvd.shutdown()
    return out


def _assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """The runs the tests below compare, on 2 ranks in one spawn: starting the processes is most of
    each run's time on 2 cores (8 spawns took ~4x one)."""
    return run_distributed(_every_run, world_size=2, timeout=240)


def _every_run() -> dict:
    holder = dtrain.init("ddp", seed=0)  # holds the group for the runs below (torch cannot build a second default group)
    try:
        return {"ddp1": ctx_steps("ddp", 1), "ddp2": ctx_steps("ddp", 2), "hvd2": ctx_steps("hvd", 2),
                "horovod1": horovod_steps(1), "horovod2": horovod_steps(2), "horovod1-fp16": horovod_steps(1, "fp16"),
                "collectives": horovod_collectives()}
    finally:
        holder.close()


@pytest.mark.parametrize("bpps", [1, 2])
def test_horovod_optimizer_matches_ddp(runs, bpps):
    hvd = [r[f"horovod{bpps}"] for r in runs]
    _assert_close(hvd[0], hvd[1], tol=0.0)
    # Same sums in a different order (fused buffers vs DDP buckets): float32 rounding only.
    _assert_close(hvd[0], runs[0][f"ddp{bpps}"], tol=1e-5)


def test_hvd_strategy_matches_ddp_with_accumulation(runs):
    hvd = [r["hvd2"] for r in runs]
    _assert_close(hvd[0], hvd[1], tol=0.0)
    _assert_close(hvd[0], runs[0]["ddp2"], tol=1e-5)


def test_horovod_fp16_compression_is_close_to_exact(runs):
    fp16 = [r["horovod1-fp16"] for r in runs]
    _assert_close(fp16[0], fp16[1], tol=0.0)
    # fp16 keeps ~3 significant digits of each gradient; after 6 small SGD steps the weights
    # differ from the exact run by far less than their scale (~0.3).
    _assert_close(fp16[0], runs[0]["horovod1"], tol=2e-3)


def horovod_collectives() -> dict:
    import dtrain.compat.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([float(r + 1), 10.0])
    out = {
        "rank": r, "size": n, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "avg": hvd.allreduce(t), "sum": hvd.allreduce(t, op=hvd.Sum), "orig": t.clone(),
    }
    u = t.clone()
    hvd.allreduce_(u, op=hvd.Sum)
    out["inplace_sum"] = u
    out["gather"] = hvd.allgather(torch.full((r + 1, 2), float(r)))  # uneven first dimension
    b = torch.tensor([float(r)])
    out["bcast"] = hvd.broadcast(b, root_rank=1)
    out["bcast_orig"] = b.clone()
    hvd.broadcast_(b, root_rank=1)
    out["bcast_inplace"] = b
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=0)
    out["join"] = hvd.join()
    hvd.shutdown()
    return out


def test_horovod_collectives(runs):
    res = [r["collectives"] for r in runs]
    for r, out in enumerate(res):
        assert (out["rank"], out["size"], out["local_rank"], out["local_size"]) == (r, 2, r, 2)
        assert torch.equal(out["avg"], torch.tensor([1.5, 10.0]))
        assert torch.equal(out["sum"], torch.tensor([3.0, 20.0]))
        assert torch.equal(out["orig"], torch.tensor([float(r + 1), 10.0]))  # not in place
        assert torch.equal(out["inplace_sum"], torch.tensor([3.0, 20.0]))
        assert torch.equal(out["gather"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert torch.equal(out["bcast"], torch.tensor([1.0]))
        assert torch.equal(out["bcast_orig"], torch.tensor([float(r)]))
        assert torch.equal(out["bcast_inplace"], torch.tensor([1.0]))
        assert out["object"] == {"from": 0}
        assert out["join"] in (0, 1)
    assert res[0]["join"] == res[1]["join"]


def dp_on_two_ranks() -> None:
    ctx = dtrain.init("dp")
    ctx.setup(_model())


def test_dp_strategy_rejects_several_processes():
    with pytest.raises(AssertionError, match="runs in one process"):
        run_distributed(dp_on_two_ranks, world_size=2, timeout=60)


# -- every method trains, and old scripts run unchanged ------------------------------------------
import json  # noqa: E402
import re  # noqa: E402

from tests.paths import ROOT  # noqa: E402
from tests.support import run_cli  # noqa: E402

EXAMPLES = ROOT / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["-n", "2", "--strategy", "ddp"],
        ["-n", "2", "--strategy", "ddp", "--launcher", "spawn"],
        ["-n", "2", "--strategy", "ddp", "--precision", "bf16-mixed"],
        ["-n", "2", "--strategy", "hvd"],
        ["-n", "1", "--strategy", "dp"],
    ],
    ids=["ddp", "ddp-spawn", "ddp-bf16", "hvd", "dp"],
)
def test_each_method_trains_digits_to_90_percent(flags):
    r = run_cli(["train", "--task", "digits", *flags], timeout=240)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["test_acc"] >= 0.90, result


@pytest.mark.slow
def test_horovod_script_runs_with_only_its_import_changed():
    r = run_cli(["run", "-n", "2", str(EXAMPLES / "horovod_style.py")], timeout=240)
    assert r.returncode == 0, r.stderr
    acc = float(re.search(r"Accuracy: ([0-9.]+)%", r.stdout).group(1))
    assert acc >= 90.0, r.stdout[-500:]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_apex_script_runs_with_only_its_imports_changed(level, tmp_path):
    ckpt = tmp_path / "ck.pt"
    r = run_cli(["run", "-n", "2", str(EXAMPLES / "apex_style.py"), "--opt-level", level, "--checkpoint", str(ckpt)], timeout=240)
    assert r.returncode == 0, r.stderr
    acc = float(re.search(r"test accuracy ([0-9.]+)", r.stdout).group(1))
    assert acc >= 0.90, r.stdout[-500:]
    saved = torch.load(ckpt, weights_only=True)
    assert set(saved) == {"model", "optimizer", "amp"} and "loss_scaler0" in saved["amp"]


def test_horovod_unsupported_features_name_themselves():
    import dtrain.compat.horovod as hvd

    hvd.init()
    try:
        opt = torch.optim.SGD(_model().parameters(), lr=0.1)
        with pytest.raises(dtrain.ConfigError, match="timeline"):
            hvd.start_timeline("t.json")
        with pytest.raises(dtrain.ConfigError, match="process_set"):
            hvd.allreduce(torch.ones(1), process_set=object())
        with pytest.raises(dtrain.ConfigError, match="unknown compression"):
            hvd.DistributedOptimizer(opt, compression="zip")
    finally:
        hvd.shutdown()
    with pytest.raises(dtrain.ConfigError, match=r"hvd.init\(\)"):
        hvd.rank()
