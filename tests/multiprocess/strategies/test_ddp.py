"""Tier 2: 2 ranks on gloo, started by dtrain.launch.local.run_distributed; each with a timeout."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from tests.support import run_distributed

STEPS = 5


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).tanh())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train_steps(batch: int, accum: int = 1, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps of ``batch`` samples per rank, in ``accum`` micro-batches each."""
    ctx = dtrain.init(seed=0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    loader = ctx.setup_dataloader(DataLoader(_data(), batch_size=batch, shuffle=True))
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with ctx.accumulate(model, steps=accum):
                ctx.backward(torch.nn.functional.mse_loss(model(xm), ym))
                opt.step()
                opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx.close()
    return state


def _assert_close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """The runs of the tests below on 2 ranks in one spawn: starting the processes is most of each
    run's time on 2 cores."""
    return run_distributed(_shared_group_runs, world_size=2, timeout=200)


def _shared_group_runs() -> dict:
    holder = dtrain.init(seed=0)  # holds the group for the runs below (torch cannot build a second default group)
    try:
        return {"whole": train_steps(8, 1), "micro": train_steps(8, 4), "calls": count_allreduces_per_micro_step(),
                "eval": evaluate_index_set(EVAL_SAMPLES)}
    finally:
        holder.close()


def test_ddp_two_ranks_equal_one_process_with_double_batch(runs):
    reference = train_steps(batch=16)  # one process, batch 2B, in this process
    ranks = [r["whole"] for r in runs]
    _assert_close(ranks[0], ranks[1], tol=0.0)  # ranks hold identical weights
    _assert_close(ranks[0], reference)


def test_four_micro_batches_equal_one_batch(runs):
    _assert_close(runs[0]["micro"], runs[0]["whole"])


def count_allreduces_per_micro_step() -> list[int]:
    """Number of DDP comm-hook calls after each of 4 micro-steps of one window."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ctx = dtrain.init(seed=0)
    model = ctx.setup(_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.module.register_comm_hook(None, counting_hook)
    x, y = _data().tensors
    seen = []
    for i in range(4):
        with ctx.accumulate(model, steps=4):
            ctx.backward(torch.nn.functional.mse_loss(model(x[i * 4 : i * 4 + 4]), y[i * 4 : i * 4 + 4]))
        seen.append(len(calls))
    ctx.close()
    return seen


def test_non_boundary_micro_steps_do_not_communicate(runs):
    seen = runs[0]["calls"]
    assert seen[:3] == [0, 0, 0], f"gradient all-reduce on a non-boundary micro-step: {seen}"
    assert seen[3] >= 1, "no all-reduce on the boundary micro-step"


class IndexSet(torch.utils.data.Dataset):
    """Sample i is (i, i): lets the metric see exactly which samples were scored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor(i)


def evaluate_index_set(n: int) -> dict:
    ctx = dtrain.init()
    model = ctx.setup(torch.nn.Identity())
    # metric = 2**index: the sum identifies the exact multiset of samples scored.
    out = ctx.evaluate(model, IndexSet(n), lambda o, y: torch.pow(2.0, y.double()), batch_size=4)
    ctx.close()
    return out


EVAL_SAMPLES = 11  # not divisible by the world size


def test_evaluation_counts_every_sample_exactly_once(runs):
    n = EVAL_SAMPLES
    for result in (r["eval"] for r in runs):
        assert result["count"] == n
        assert result["metric"] * n == sum(2.0**i for i in range(n))


def ddp_objects_alive_after_close() -> tuple[str, int]:
    import gc

    ctx = dtrain.init(seed=0)
    model = ctx.setup(_model())
    ctx.backward(model(torch.ones(2, 6)).sum())
    ctx.close()
    gc.collect()
    alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    return type(model.module).__name__, alive


def test_close_frees_ddp_before_leaving_the_group():
    # A DDP object outliving its process group can abort the process at exit with torch 2.13
    # + gloo (a gloo worker thread frees a finished work item during interpreter finalisation).
    for inner, alive in run_distributed(ddp_objects_alive_after_close, world_size=2, timeout=120):
        assert (inner, alive) == ("Sequential", 0)
