"""Composed parallelisms (``--parallel``): ParallelDims, tensor parallelism on ``lm``, FSDP x TP,
DDP x TP, PP x DP, PP x TP and HSDP x TP against one process, checkpoints that load into another
layout.

Tier 1: the layout value and its errors, the TP plan, the norm's bookkeeping. Tier 2: 2-8 ranks on
gloo (slow on 2 cores: one run per composition, each with a timeout).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, Subset

import dtrain
from dtrain.tasks import load_task
from tests.support import run_cli, run_distributed

TINY = {"layers": "2", "heads": "4", "width": "32", "context": "16", "max_bytes": "40000"}
STEPS = 4
CLIP = 0.5  # below the first steps' gradient norm (~1), so clipping acts and a wrong norm shows
# fp32: TP splits each matmul's sum over tp ranks and FSDP/DDP average half-batch means, so sums
# are reordered; after 4 steps losses and weights agree to ~1e-6 (measured), a wrong norm or a
# missing reduction moves them by > 1e-3.
TOL = 2e-5
# bf16-mixed: autocast's bf16 matmuls keep 8 bits of mantissa and TP/DP split and reorder their
# sums, so results round differently (relative 2^-8 per operation): measured after 4 steps,
# losses differ by 1.1e-3 and norms by 1.8e-3 under dp x tp (1e-4 / 5e-4 under tp=2). The fp32
# run of the same layout, to 2e-5, is the check on the sums; this one on autocast's path.
TOL_BF16 = 1e-2


# -- tier 2: 4 ranks against one process ----------------------------------------------------------
def train(layout: str | None, switches: dict | None = None, task_args: dict | None = None) -> tuple[dict, dict]:
    """The same training in fp32, then in bf16 autocast (what ``bf16-mixed`` does), on one
    context (starting 4 processes is the slow part)."""
    task = load_task("lm", options={**TINY, **(task_args or {})})
    extra = {"parallel": layout, "tp_plan": task.tp_plan} if layout else {}
    ctx = dtrain.init("auto" if layout else "single", seed=0, **extra, **(switches or {}))
    out = _steps(ctx, task, torch.float32), _steps(ctx, task, torch.bfloat16)
    ctx.close()
    return out


def _steps(ctx, task, dtype: torch.dtype) -> dict:
    """``STEPS`` SGD steps with gradient clipping: losses, norms before clipping, full weights."""
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = ctx.setup(model, opt, blocks=task.blocks(model))
    it = iter(ctx.setup_dataloader(DataLoader(task.train_set, batch_size=16 // ctx.data_parallel_size, shuffle=True)))
    losses, norms = [], []
    for _ in range(STEPS):
        x, y = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = ctx.forward_backward(model, x, y, task.loss_fn)
        norms.append(float(ctx.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(ctx.all_reduce(loss.float().clone(), op="mean").item())
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in ctx.unwrap(model).state_dict().items()}
    if ctx.strategy.capabilities.staged_step:  # pipeline stages: each rank holds its stage's layers
        state = {k: v for part in ctx.gather_object(state) for k, v in part.items()}
    # 123 windows in batches of 61: data-parallel rank 0 scores 62 (2 batches), rank 1 61 (1
    # batch, then a padding forward through every stage); TP ranks score the same windows once.
    scored = ctx.evaluate(model, Subset(task.test_set, range(123)), task.metric, batch_size=61, loss_fn=task.loss_fn)
    return {"losses": losses, "norms": norms, "state": state, "strategy": ctx.strategy.name, "eval": scored}


def _assert_close(got: dict, ref: dict, tol: float) -> None:
    assert got["eval"]["count"] == ref["eval"]["count"] == 123, (got["eval"], ref["eval"])
    for name in ("metric", "loss"):
        assert abs(got["eval"][name] - ref["eval"][name]) <= tol, (got["eval"], ref["eval"])
    for name in ("losses", "norms"):
        assert all(abs(a - b) <= tol for a, b in zip(got[name], ref[name], strict=True)), f"{name}: {got[name]} vs {ref[name]}"
    assert got["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        diff = (got["state"][k].float() - ref["state"][k].float()).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


def _check(ranks: list[tuple[dict, dict]], task_args: dict | None = None) -> None:
    ref32, ref16 = train(None, None, task_args)
    assert ref32["norms"][0] > CLIP  # clipping acts
    for fp32, bf16 in ranks:
        assert fp32["strategy"] == "composed"
        _assert_close(fp32, ref32, TOL)
        _assert_close(bf16, ref16, TOL_BF16)


UNTIED = {"tie": "false"}  # tied weights cannot span pipeline stages
#: The 4-rank layouts of the tests below, with their task's options.
FOUR = {"dp_shard=2,tp=2": None, "dp_replicate=2,tp=2": None,
        "pp=2,dp_shard=2": UNTIED, "pp=2,dp_replicate=2": UNTIED, "pp=2,tp=2": UNTIED}


def _each_layout() -> dict[str, tuple[dict, dict]]:
    """``train`` in each of FOUR's layouts, one after another in one process group: starting 4
    processes is most of each run's time on 2 cores."""
    holder = dtrain.init("ddp", seed=0)  # holds the group for the runs (torch cannot build a second default group)
    try:
        return {layout: train(layout, None, task_args) for layout, task_args in FOUR.items()}
    finally:
        holder.close()


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, tuple[dict, dict]]]:
    return run_distributed(_each_layout, world_size=4, timeout=850)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_x_tp_matches_one_process_with_clipping_in_fp32_and_bf16(four_ranks):
    _check([r["dp_shard=2,tp=2"] for r in four_ranks])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_x_tp_matches_one_process_with_clipping_in_fp32_and_bf16(four_ranks):
    _check([r["dp_replicate=2,tp=2"] for r in four_ranks])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [name for name in FOUR if name.startswith("pp=")])
def test_pp_x_dp_or_tp_matches_one_process_with_clipping_in_fp32_and_bf16(four_ranks, layout):
    # Two stages (embedding + block0 | block1 + head: tied weights cannot span stages), each
    # sharded (FSDP2), replicated, or split by TP (sequence-sharded activations pass between the
    # stages of each TP rank) over 2 ranks; 4 micro-batches per data-parallel rank.
    _check([r[layout] for r in four_ranks], task_args=UNTIED)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_x_tp_on_8_processes_matches_one_process():
    # Each parameter split over 2 TP ranks, that piece sharded over 2 ranks and replicated twice
    # (a 3-D mesh; ~45 s on 2 cores: 8 processes).
    _check(run_distributed(train, "dp_replicate=2,dp_shard=2,tp=2", world_size=8, timeout=550))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_with_activation_checkpointing_matches_one_process(two_ranks):
    _check([r["tp=2"] for r in two_ranks])


def _train_cli(ckpt, layout: str | None, nproc: int, steps: int, batch: int, *extra: str, task_args: dict | None = None) -> tuple[dict, str]:
    args = ["train", "--task", "lm", "--max-steps", str(steps), "--batch-size", str(batch), "--log-every", "1",
            "--checkpoint-dir", str(ckpt), "--resume", "-n", str(nproc), *extra]
    args += ["--parallel", layout] if layout else []
    for key, value in {**TINY, **(task_args or {})}.items():
        args += ["--task-arg", f"{key}={value}"]
    r = run_cli(args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_of_fsdp_x_tp_resumes_under_fsdp_and_one_process(tmp_path):
    ckpt = tmp_path / "ck"
    first, _ = _train_cli(ckpt, "dp_shard=2,tp=2", 4, 2, 8)   # global batch 16 (2 data-parallel ranks)
    assert first["strategy"] == "composed" and first["steps"] == 2
    # Another layout on another world size (no tp dimension, 2 ranks): 2 fewer processes to start
    # than dp_shard=4 on 4, the same resharding of every parameter.
    second, log = _train_cli(ckpt, "dp_shard=2", 2, 3, 8)     # global batch 16 again
    assert "resumed from" in log and "at step 2 (saved by 4 process(es))" in log, log[-2000:]
    assert second["strategy"] == "fsdp" and second["steps"] == 3
    third, log = _train_cli(ckpt, None, 1, 4, 16)
    assert "at step 3 (saved by 2 process(es))" in log, log[-2000:]
    assert third["steps"] == 4 and third["train_loss"] == third["train_loss"]  # one more step ran (not NaN)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_of_pp_x_dp_resumes_in_one_process_where_an_unbroken_run_would_be(tmp_path):
    untied = {"tie": "false"}  # tied weights cannot span pipeline stages
    # 2 steps under pp=2,dp_shard=2 (2 data-parallel ranks x 8 = the global batch of 16, in 2
    # micro-batches each), then step 3 in one process from that checkpoint ...
    first, _ = _train_cli(tmp_path / "ck", "pp=2,dp_shard=2", 4, 2, 8, "--microbatches", "2", task_args=untied)
    assert first["strategy"] == "composed" and first["steps"] == 2
    resumed, log = _train_cli(tmp_path / "ck", None, 1, 3, 16, task_args=untied)
    assert "at step 2 (saved by 4 process(es))" in log, log[-2000:]
    # ... gives what 3 unbroken steps in one process give: the same weights, optimizer state and
    # data position (the third batch), so the same training loss and validation loss.
    unbroken, _ = _train_cli(tmp_path / "ck1", None, 1, 3, 16, task_args=untied)
    for key in ("train_loss", "val_loss"):
        assert abs(resumed[key] - unbroken[key]) <= 1e-4, (key, resumed[key], unbroken[key])


def _one_way(strategy: str, parallel: str | None, comm: str | None) -> dict:
    """5 clipped SGD steps of a small Sequential (2 ranks; --comm after 2); everything that could differ."""
    ctx = dtrain.init(strategy, seed=0, parallel=parallel, comm=comm, comm_warmup=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model, opt = ctx.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 4, generator=g))
    it = iter(ctx.setup_dataloader(DataLoader(data, batch_size=8, shuffle=True)))
    losses, norms = [], []
    for _ in range(5):
        x, y = next(it)
        losses.append(ctx.forward_backward(model, x, y, torch.nn.functional.mse_loss).item())
        norms.append(ctx.clip_grad_norm_(model, 0.05).item())
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "norms": norms, "name": ctx.strategy.name, "record": ctx.strategy.comm_record(),
           "state": {k: v.tolist() for k, v in ctx.unwrap(model).state_dict().items()},
           "checkpoint": ctx.strategy.state_dict() is not None, "data": ctx.strategy.data_parallel(ctx.world)}
    ctx.close()
    return out


ONE_WAY = [("dp_replicate=2", "ddp", "powersgd:2"), ("pp=2", "pipeline", None)]


def _two_rank_runs() -> dict:
    """The 2-rank runs of the tests here, in one process group (starting processes is the slow part)."""
    holder = dtrain.init("ddp", seed=0)  # holds the group for the runs (torch cannot build a second default group)
    try:
        out = {"tp=2": train("tp=2", {"activation_checkpointing": True})}
        for layout, named, comm in ONE_WAY:
            out[layout], out[named] = _one_way("auto", layout, comm), _one_way(named, None, comm)
        return out
    finally:
        holder.close()


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_two_rank_runs, world_size=2, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, named, comm", ONE_WAY)
def test_a_layout_of_one_way_runs_as_the_named_strategy_bit_for_bit(two_ranks, layout, named, comm):
    # The same preset and the same way: the same losses, norms, weights, record and checkpoint
    # entries to the last bit, --comm included.
    by_layout, by_name = [r[layout] for r in two_ranks], [r[named] for r in two_ranks]
    assert by_layout == by_name and by_layout[0]["name"] == named
