"""`dtrain plan --verify`'s glue, in-process: the dry run each planned layout gets (its strategy or
``--parallel`` string, the plan's precision and batch, rank 0 of the planned world), and how the
measured figures sit beside the plan's. The dry run itself forms a (fake) process group, so here
it is replaced by a stand-in that returns a record; tests/multiprocess/dryrun/test_verify.py runs it."""

from __future__ import annotations

import json

import pytest

from dtrain.cli import main as cli_main
from dtrain.dryrun import verify as vmod
from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims
from dtrain.plan.layouts import Layout
from dtrain.train.config import TaskConfig

TINY = ["--task", "lm", "--task-arg", "layers=1", "--task-arg", "width=32", "--task-arg", "heads=2",
        "--task-arg", "context=16", "--task-arg", "max_bytes=100000", "--batch-size", "2"]


def job(**kw):
    return vmod.Job(task=TaskConfig(name="lm"), batch=4, **kw)


def test_each_layout_becomes_the_dry_run_train_would_run():
    fsdp = vmod.config_for(Layout("fsdp", ParallelDims(dp_shard=8)), job(fsdp_options={"reduce_dtype": "bf16"}), 16, 8)
    assert (fsdp.parallel.strategy, fsdp.parallel.layout, fsdp.parallel.strategy_options) == ("fsdp", None, {"reduce_dtype": "bf16"})
    assert (fsdp.world_size, fsdp.local_size, fsdp.rank, fsdp.batch.size) == (16, 8, 0, 4)
    ddp = vmod.config_for(Layout("ddp", ParallelDims(dp_replicate=8)), job(fsdp_options={"reduce_dtype": "bf16"}), 8, 8)
    assert (ddp.parallel.strategy, ddp.parallel.strategy_options) == ("ddp", {})  # fsdp's options only where it shards
    tp = vmod.config_for(Layout("dp_shard=2,tp=4", ParallelDims(dp_shard=2, tp=4)), job(precision="bf16-mixed"), 8, 8)
    assert (tp.parallel.strategy, tp.parallel.layout, tp.runtime.precision) == ("auto", "dp_shard=2,tp=4", "bf16-mixed")
    assert vmod.config_for(Layout("single", ParallelDims()), job(), 1, 1).parallel.strategy == "auto"


class _Pred:
    def __init__(self, name, memory, dims):
        self.layout = Layout(name, dims)
        self.memory = memory
        self.fits = True

    @property
    def state_bytes(self):
        return sum(self.memory.get(k, 0.0) for k in ("params", "grads", "optimizer"))


def test_measured_beside_planned_and_fits_by_the_measured_peak(monkeypatch):
    mib = 2**20
    pred = _Pred("fsdp", {"params": 10 * mib, "grads": 10 * mib, "optimizer": 20 * mib, "activations": 60 * mib,
                          "fixed": 1024 * mib}, ParallelDims(dp_shard=8))
    bad = _Pred("dp_shard=2,tp=4", {"params": mib}, ParallelDims(dp_shard=2, tp=4))
    seen = []

    def fake_dry_run(cfg, with_prediction=True):
        seen.append(cfg)
        if cfg.parallel.layout:
            raise ConfigError("task 'lm': heads=2 cannot be split over tp=4 ranks; use a head count divisible by 4.")
        return {"peak_mib": 80.0, "state_mib": 40.0, "peak_kind": "tensors", "device": "cpu", "collectives": [], "wall_s": 1.0}

    monkeypatch.setattr("dtrain.dryrun.dry_run", fake_dry_run)
    got = vmod.verify([pred, bad], job(), 8, 8, capacity=1100 * mib)
    assert [c.parallel.strategy for c in seen] == ["fsdp", "auto"]
    ok, no = got
    assert ok["planned"] == {"peak_mib": 100.0, "state_mib": 40.0, "fits": True}  # the CUDA context is not a tensor
    assert ok["measured"]["peak_mib"] == 80.0 and ok["plan_error"] == {"peak_mib": 0.25, "state_mib": 0.0}
    assert ok["measured"]["fits"] is False  # 80 MiB measured + the plan's 1024 MiB context > 1100 MiB
    assert "heads=2 cannot be split over tp=4" in no["impossible"] and "measured" not in no
    text = vmod.lines(got, 8)
    assert len(text) == 2 and "plan +25.0%" in text[0] and "does NOT fit" in text[0]
    assert text[1].startswith("verify dp_shard=2,tp=4 (rank 0 of 8, dry run): cannot run: task 'lm': heads=2")


@pytest.mark.timeout(120)
def test_plan_verify_dry_runs_the_pick_and_each_layout_given(monkeypatch, capsys):
    calls = []

    def fake_dry_run(cfg, with_prediction=True):
        calls.append(cfg)
        return {"peak_mib": 1.0, "state_mib": 0.5, "peak_kind": "tensors", "device": "cpu", "collectives": [], "wall_s": 0.1}

    monkeypatch.setattr("dtrain.dryrun.dry_run", fake_dry_run)
    assert cli_main(["plan", *TINY, "-n", "4", "--layouts", "ddp;fsdp", "--comm-methods", "none,bf16", "--no-layout-profile",
                     "--json", "--verify"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    verified = [v["layout"] for v in out["verify"]]
    assert verified[0] == out["best"]["layout"] and sorted(verified) == ["ddp", "fsdp"]
    assert all(c.world_size == 4 and c.local_size == 4 and c.batch.size == 2 for c in calls)
    assert cli_main(["plan", *TINY, "-n", "4", "--layouts", "fsdp", "--no-layout-profile"]) == 0
    assert len(calls) == 2 and "verify" not in capsys.readouterr().out  # without --verify, no dry run
    assert cli_main(["plan", *TINY, "-n", "4", "--layouts", "fsdp", "--no-layout-profile", "--fsdp-reduce", "bf16",
                     "--verify"]) == 0
    assert calls[-1].parallel.strategy_options == {"reduce_dtype": "bf16"}  # the dry run reduces as planned
    assert capsys.readouterr().out.splitlines()[-1].startswith("verify fsdp (rank 0 of 4, dry run): peak 1 MiB")
