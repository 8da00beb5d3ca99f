"""Sharded data parallel (zero1, fsdp) and pipeline parallel against single-process training.

Tier 1: plain logic (wrap policies, stage bounds). Tier 2: 2 ranks on gloo, each with a timeout.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from dtrain.cli import main as cli_main
from tests.logic.strategies.test_sharded import _model
from tests.support import run_distributed

STEPS = 6
# Tolerance of the parity tests, in fp32. The sharded runs compute the same mathematics as one
# process, in another order: a gradient is the mean of two half-batch means (all-reduce or
# reduce-scatter) instead of one mean, and the pipeline sums micro-batch losses. Each such
# reordering moves a value by a few ulps (~1e-7 relative); Adam divides by sqrt(v), which keeps
# per-step updates at lr scale, so after 6 steps the drift stays below 1e-5 absolute on weights
# of magnitude ~0.3 and losses ~1. A real bug (a missing 1/N, a skipped shard) moves them by > 1e-2.
TOL = 2e-5


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).tanh())


def _full_state(ctx: dtrain.Context, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (fsdp: gathered shards; pipeline: every stage)."""
    state = {}
    for k, v in ctx.unwrap(model).state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        state[k] = v.detach().clone()
    if ctx.strategy.name == "pipeline":
        merged: dict[str, torch.Tensor] = {}
        for part in ctx.gather_object(state):
            merged.update(part)
        state = merged
    return state


def train(strategy: str, batch: int, accum: int = 1, clip: float | None = None, options: dict | None = None,
          steps: int = STEPS) -> dict:
    """``steps`` Adam steps of ``batch`` samples per data-parallel rank; losses and final weights."""
    ctx = dtrain.init(strategy, seed=0, **(options or {}))
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.setup(model, opt)
    loader = ctx.setup_dataloader(DataLoader(_data(), batch_size=batch, shuffle=True))
    it = iter(loader)
    losses, norms, memory = [], [], None
    loss_fn = torch.nn.functional.mse_loss
    for _ in range(steps):
        x, y = next(it)
        step_loss = torch.zeros(())
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with ctx.accumulate(model, steps=accum):
                step_loss += ctx.forward_backward(model, xm, ym, loss_fn) / accum
                if ctx.sync_gradients and clip is not None:
                    norms.append(ctx.clip_grad_norm_(model, clip).item())
                opt.step()
                if ctx.sync_gradients and memory is None:  # gradients and optimizer state both exist
                    memory = ctx.memory_report(model).as_dict()
                opt.zero_grad()
        losses.append(ctx.all_reduce(step_loss, op="mean").item())
    out = {"losses": losses, "norms": norms, "state": _full_state(ctx, model), "memory": memory}
    ctx.close()
    return out


def _assert_close(got: dict, ref: dict, tol: float = TOL) -> None:
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= tol, f"loss curves differ: {got['losses']} vs {ref['losses']}"
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"gradient norms differ: {got['norms']} vs {ref['norms']}"
    assert got["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        diff = (got["state"][k] - ref["state"][k]).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


# -- tier 2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, batch 16 (= 2 ranks x 8), clipped at 0.5 (it does clip: norms are ~1-3)."""
    return train("single", 16, clip=0.5)


PIPELINES = (("gpipe", 1), ("1f1b", 2))
SAVED = ("fsdp", "pipeline", "zero1")


def _in_one_group(folder: str) -> dict:
    """Every 2-rank run of the tests below in one process group (starting 2 processes is most of
    each run's time on 2 cores); the checkpoints of each strategy in ``folder``/STRATEGY."""
    holder = dtrain.init("ddp", seed=0)  # holds the group for the runs (torch cannot build a second default group)
    try:
        return {
            "zero1": train("zero1", 8, 1, 0.5),
            # 2 micro-batches per step: gradients accumulate unsharded without a reduce-scatter first.
            "fsdp": train("fsdp", 8, 2, 0.5), "ddp": train("ddp", 8, 1, None, None, 1),
            # No data parallelism: both stages see the whole batch of 16, in 4 micro-batches (of 2 or 4
            # samples: with accum 2, each of the 2 micro-steps of 8 samples is cut into 4).
            **{f"pipeline-{schedule}": train("pipeline", 16, accum, 0.5, {"schedule": schedule}) for schedule, accum in PIPELINES},
            # shard_size 1: a 2 x 1 device mesh (replicated over 2 groups of 1), torch's HSDP path on gloo.
            "hsdp": train("hsdp", 8, 1, 0.5, {"shard_size": 1}),
            "uneven": evaluate_uneven("fsdp"),
            # Data parallel strategies see 2 x 8 samples per step; pipeline sees the 16 on both stages.
            **{f"saved-{s}": save_after_steps(s, os.path.join(folder, s), 8 if s != "pipeline" else 16) for s in SAVED},
        }
    finally:
        holder.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, list[dict]]:
    folder = str(tmp_path_factory.mktemp("saved"))
    return folder, run_distributed(_in_one_group, folder, world_size=2, timeout=200)


@pytest.mark.timeout(220)
def test_zero1_matches_one_process(reference, runs):
    for rank in runs[1]:
        _assert_close(rank["zero1"], reference)


@pytest.mark.timeout(220)
def test_fsdp_matches_one_process_with_accumulation(reference, runs):
    for rank in runs[1]:
        _assert_close(rank["fsdp"], reference)


@pytest.mark.timeout(220)
def test_fsdp_holds_about_half_of_ddp_state_per_rank(runs):
    for d, f in ((rank["ddp"], rank["fsdp"]) for rank in runs[1]):
        dm, fm = d["memory"], f["memory"]
        assert dm["grads_bytes"] > 0 and dm["optimizer_bytes"] > 0 and fm["grads_bytes"] > 0 and fm["optimizer_bytes"] > 0
        # Every tensor of this model splits evenly over 2 ranks; the rest is Adam's per-tensor
        # step counters (not sharded), a few bytes.
        assert fm["state_bytes"] <= 0.55 * dm["state_bytes"], (fm, dm)


@pytest.mark.timeout(220)
@pytest.mark.parametrize("schedule", [s for s, _ in PIPELINES])
def test_pipeline_matches_one_process(reference, runs, schedule):
    for rank in runs[1]:
        _assert_close(rank[f"pipeline-{schedule}"], reference)


# -- checkpoints ----------------------------------------------------------------------------------
def save_after_steps(strategy: str, folder: str, batch: int) -> dict:
    """Train STEPS steps, save a checkpoint; the full weights and the next step's loss."""
    ctx = dtrain.init(strategy, seed=0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.setup(model, opt)
    x, y = _data().tensors
    if ctx.data_parallel_size > 1:  # this rank's half of the 16 samples
        x, y = x[ctx.rank * batch:], y[ctx.rank * batch:]
    loss_fn = torch.nn.functional.mse_loss
    for _ in range(STEPS):
        ctx.forward_backward(model, x[:batch], y[:batch], loss_fn)
        opt.step()
        opt.zero_grad()
    ctx.checkpoints(folder).save(STEPS, model=model, optimizer=opt)
    weights = _full_state(ctx, model)
    ctx.forward_backward(model, x[:batch], y[:batch], loss_fn)  # the step after: tests the optimizer state too
    opt.step()
    out = {"state": weights, "after": _full_state(ctx, model)}
    ctx.close()
    return out


def resume_one_process(folder: str, batch: int) -> dict:
    ctx = dtrain.init("single", seed=0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.setup(model, opt)
    meta = ctx.checkpoints(folder).resume(model=model, optimizer=opt)
    weights = _full_state(ctx, model)
    x, y = _data().tensors
    ctx.forward_backward(model, x[:batch], y[:batch], torch.nn.functional.mse_loss)
    opt.step()
    out = {"state": weights, "after": _full_state(ctx, model), "step": meta["step"]}
    ctx.close()
    return out


def _assert_states(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


@pytest.mark.timeout(220)
@pytest.mark.parametrize("strategy", SAVED)
def test_checkpoint_saved_on_two_ranks_resumes_on_one(tmp_path, runs, strategy):
    folder, saved = os.path.join(runs[0], strategy), runs[1][0][f"saved-{strategy}"]
    resumed = resume_one_process(folder, 16)
    assert resumed["step"] == STEPS
    _assert_states(resumed["state"], saved["state"], 0.0)  # the weights, bit for bit
    # One more step from the restored Adam moments lands where the 2-rank run's next step did.
    _assert_states(resumed["after"], saved["after"], TOL)
    if strategy != "zero1":  # zero1 checkpoints are full-state (one file) already
        assert os.path.isdir(os.path.join(folder, f"step-{STEPS:08d}", "sharded"))
    # `dtrain ckpt consolidate`: one plain state dict that a fresh, unwrapped model loads.
    out = tmp_path / "model.pt"
    assert cli_main(["ckpt", "consolidate", folder, str(out)]) == 0
    plain = torch.load(out, weights_only=True)
    _model().load_state_dict(plain)
    _assert_states(plain, saved["state"], 0.0)


@pytest.mark.timeout(220)
def test_hsdp_two_replicas_match_one_process(reference, runs):
    _assert_close(runs[1][0]["hsdp"], reference)


@pytest.mark.timeout(150)
def test_train_cli_pipeline_reports_memory_and_evaluates(tmp_path):
    from tests.support import run_cli

    out = run_cli(["train", "--task", "digits", "--strategy", "pipeline", "--pipeline-schedule", "gpipe", "-n", "2",
                   "--max-steps", "4", "--log-every", "2"], cwd=str(tmp_path), timeout=140)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"memory after the first step: rank {rank}: params" in out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["strategy"] == "pipeline" and result["steps"] == 4 and result["test_acc"] > 0.2  # 10 classes


def evaluate_uneven(strategy: str) -> dict:
    ctx = dtrain.init(strategy, seed=0)
    model = ctx.setup(_model())
    x, y = _data().tensors
    # 5 samples over 2 ranks in batches of 2: rank 0 runs 2 forwards, rank 1 runs 1.
    out = ctx.evaluate(model, TensorDataset(x[:5], y[:5]), lambda o, t: (o - t).pow(2).mean(1), batch_size=2)
    ctx.close()
    return out


@pytest.mark.timeout(220)
def test_fsdp_evaluation_with_uneven_batches_does_not_hang(runs):
    one = evaluate_uneven("single")
    for got in (rank["uneven"] for rank in runs[1]):
        assert got["count"] == 5 and abs(got["metric"] - one["metric"]) < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_resume_is_exact(tmp_path, capsys):
    """8 steps straight (saving at step 4 too), and a run resumed from (a copy of) that step-4 save
    to 8, end in identical checkpoints. (A run stopped by --max-steps makes the same save:
    tests/multiprocess/checkpoint/test_resume.py.)"""
    from tests.support import run_cli

    common = ["train", "--task", "digits", "--strategy", "fsdp", "--fsdp-wrap", "Linear", "-n", "2", "--log-every", "4"]
    out = run_cli(common + ["--max-steps", "8", "--save-every", "4", "--checkpoint-dir", "a"], cwd=str(tmp_path), timeout=100)
    assert out.returncode == 0, out.stderr
    shutil.copytree(tmp_path / "a" / "step-00000004", tmp_path / "b" / "step-00000004")
    out = run_cli(common + ["--max-steps", "8", "--checkpoint-dir", "b", "--resume"], cwd=str(tmp_path), timeout=100)
    assert out.returncode == 0, out.stderr
    assert "resumed from b/step-00000004 at step 4" in out.stderr
    # `dtrain ckpt diff` reads files only: in this process.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    capsys.readouterr()
    assert cli_main(["ckpt", "diff", a, b]) == 0
    diff = capsys.readouterr().out
    assert "identical" in diff, diff[-2000:]
    # The sharded entries were compared too (they live in sharded/, not in state.pt).
    assert cli_main(["ckpt", "diff", a, b, "--only", "optimizer"]) == 0
    opt = capsys.readouterr().out
    assert "identical" in opt and int(opt.split()[-4]) > 0, opt[-500:]
