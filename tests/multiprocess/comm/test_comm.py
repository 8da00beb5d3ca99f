"""--comm: parsing and auto's rule (tier 1); every method against plain DDP on 2 ranks, local SGD's
averaging, the communication state through a checkpoint, and the CLI (tier 2, gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from dtrain.comm import CommSpec
from tests.support import run_cli, run_distributed

# -- tier 2: 2 ranks on gloo ------------------------------------------------------------------
MODES = ("none", "fp16", "bf16", "powersgd:2", "localsgd:4")


def train_digits_each_mode(modes: tuple[str, ...], epochs: int) -> dict[str, dict]:
    """The built-in loop on `digits` once per mode, in one process group (one spawn for all)."""
    from dtrain.train import TrainConfig, run
    from dtrain.train.config import ParallelConfig, ScheduleConfig
    from dtrain.world import World, destroy_process_group, init_process_group

    world = World.detect()
    init_process_group(world)
    try:
        return {m: run(TrainConfig(parallel=ParallelConfig(comm=CommSpec.parse(m)), schedule=ScheduleConfig(seed=0, epochs=epochs)),
                       world=world) for m in modes}
    finally:
        destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_method_trains_digits_within_one_point_of_plain_ddp():
    pytest.importorskip("sklearn")
    results = run_distributed(train_digits_each_mode, MODES, 20, world_size=2, timeout=280)[0]
    plain = results["none"]["test_acc"]
    print({m: r["test_acc"] for m, r in results.items()})
    for mode in MODES[1:]:
        r = results[mode]
        assert r["comm"] == mode and r["comm_choice"] == mode
        assert abs(r["test_acc"] - plain) <= 0.01, f"{mode}: test accuracy {r['test_acc']:.4f} vs plain DDP {plain:.4f}"


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).tanh())


def train_small(comm: str, warmup: int, steps: int, ckpt: str | None = None, save_at: int | None = None) -> dict:
    """``steps`` SGD-with-momentum steps of a small MLP; every rank's parameters after each step.
    With ``ckpt``: resume from it if it holds a checkpoint, save at step ``save_at``."""
    ctx = dtrain.init("ddp", seed=0, comm=comm, comm_warmup=warmup)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ctx.setup(model, opt)
    loader = ctx.setup_dataloader(DataLoader(_data(), batch_size=16, shuffle=True))
    manager = ctx.checkpoints(ckpt) if ckpt else None
    step, comm_state = 0, {}
    if manager is not None:
        meta = manager.resume(model=model, optimizer=opt, loader=loader)
        step = meta["step"] if meta else 0
        comm_state["loaded"] = ctx.strategy.state_dict()
    history = {}
    while step < steps:
        for x, y in loader:
            ctx.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            history[step] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
            if manager is not None and step == save_at:
                manager.save(step, model=model, optimizer=opt, loader=loader)
                comm_state["saved"] = ctx.strategy.state_dict()
            if step == steps:
                break
    record = ctx.strategy.comm_record()
    ctx.close()
    return {"history": history, "record": record, "comm_state": comm_state}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _in_one_group(runs: dict[str, tuple]) -> dict[str, dict]:
    """Each of ``runs`` (name: train_small's arguments) in one process group: starting 2 processes
    is most of each run's time on 2 cores."""
    holder = dtrain.init("ddp", seed=0)  # holds the group for the runs (torch cannot build a second default group)
    try:
        return {name: train_small(*args) for name, args in runs.items()}
    finally:
        holder.close()


def _runs(runs: dict[str, tuple]) -> list[dict[str, dict]]:
    return run_distributed(_in_one_group, runs, world_size=2, timeout=200)


def _folder(root: str, comm: str) -> str:
    return f"{root}/{comm.replace(':', '-')}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[str, list[dict[str, dict]]]:
    """The uninterrupted runs of the tests below, in one spawn; the checkpoint tests resume from
    their saves in fresh processes."""
    folder = str(tmp_path_factory.mktemp("comm"))
    return folder, _runs({
        **{comm: (comm, 3, 12) for comm in ("none", "localsgd:1", "localsgd:4")},
        # Saved at step 8 while running on to 14 (the state round trip).
        **{f"saved-{comm}": (comm, 3, 14, _folder(folder, comm), 8) for comm in ("localsgd:4", "powersgd:1")},
        # auto: saved after its choice (step 10 of 14, warm-up 6), and during its warm-up (step 4).
        "auto-after": ("auto", 6, 14, f"{folder}/after", 10), "auto-during": ("auto", 6, 14, f"{folder}/during", 4)})


@pytest.fixture(scope="module")
def resumed(straight) -> list[dict[str, dict]]:
    folder, _ = straight
    return _runs({**{comm: (comm, 3, 14, _folder(folder, comm)) for comm in ("localsgd:4", "powersgd:1")},
                  "auto-after": ("auto", 6, 14, f"{folder}/after"), "auto-during": ("auto", 6, 14, f"{folder}/during")})


@pytest.mark.timeout(220)
def test_localsgd_1_equals_plain_ddp_and_averaging_makes_ranks_identical(straight):
    plain, every, local = ([r[comm] for r in straight[1]] for comm in ("none", "localsgd:1", "localsgd:4"))
    for step in (4, 12):  # after the warm-up: local steps, each followed by an average
        assert _max_diff(every[0]["history"][step], plain[0]["history"][step]) <= 1e-5
    # localsgd:4 with a warm-up of 3: averages after steps 4, 8, 12; steps between are local.
    for step in (4, 8, 12):
        assert _max_diff(local[0]["history"][step], local[1]["history"][step]) == 0.0, step
    for step in (5, 6, 7):
        assert _max_diff(local[0]["history"][step], local[1]["history"][step]) > 1e-6, f"step {step} was not local"


def _assert_same_state(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _local_tensor(result: dict) -> torch.Tensor:
    """One tensor of this rank's own communication state: local SGD's first momentum buffer, or
    PowerSGD's error feedback."""
    local = result["comm_state"]["saved"]["state"]["local"]
    if "optimizers" in local:
        return local["optimizers"][0][0]["momentum_buffer"]
    return next(iter(local["error"].values()))


@pytest.mark.timeout(220)
def test_comm_state_round_trips_through_a_checkpoint(straight, resumed):
    # Saved at step 8 while running on to 14, then resumed from step 8 in fresh processes.
    for comm in ("localsgd:4", "powersgd:1"):
        ran, back = [r[f"saved-{comm}"] for r in straight[1]], [r[comm] for r in resumed]
        assert sorted(back[0]["history"]) == list(range(9, 15))
        for rank in (0, 1):  # each rank gets its own state back (error feedback, momentum: per rank)
            saved, loaded = ran[rank]["comm_state"]["saved"], back[rank]["comm_state"]["loaded"]
            _assert_same_state(saved, loaded, f"{comm} rank {rank}")
        # ... and that matters: the per-rank parts differ between the ranks.
        assert not torch.equal(_local_tensor(ran[0]), _local_tensor(ran[1])), comm
        if comm.startswith("local"):  # local SGD resumes exactly: the same weights at the end
            for rank in (0, 1):
                assert _max_diff(back[rank]["history"][14], ran[rank]["history"][14]) == 0.0, f"rank {rank}"


@pytest.mark.timeout(220)
def test_auto_keeps_ranks_in_step_through_its_warmup_and_resumes(straight, resumed):
    ran = [r["auto-after"] for r in straight[1]]
    for step in range(1, 7):  # 2 plain steps, then PowerSGD: every rank applies the same update
        assert _max_diff(ran[0]["history"][step], ran[1]["history"][step]) <= 1e-6, step
    choice = ran[0]["record"]["comm_choice"]
    assert choice is not None and ran[1]["record"]["comm_choice"] == choice
    # Saved after the choice: the resumed run goes on with it, each rank with its own state.
    back = [r["auto-after"] for r in resumed]
    for rank in (0, 1):
        _assert_same_state(ran[rank]["comm_state"]["saved"], back[rank]["comm_state"]["loaded"], f"auto rank {rank}")
        assert back[rank]["record"]["comm_choice"] == choice
    # Saved during the warm-up: the resumed run measures again, in its own DDP, and chooses.
    again = resumed[0]["auto-during"]
    assert sorted(again["history"]) == list(range(5, 15))
    loaded = again["comm_state"]["loaded"]["state"]["shared"]
    assert (loaded["iter"], loaded["choice"]) == (0, None)
    assert again["record"]["comm_choice"] is not None


@pytest.mark.timeout(120)
def test_cli_comm_auto_prints_its_choice_and_numbers():
    pytest.importorskip("sklearn")
    proc = run_cli(["train", "--task", "digits", "-n", "2", "--max-steps", "30", "--comm", "auto", "--comm-warmup", "8"],
                   timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if "--comm auto:" in x)
    assert "ms/step" in line and "MB/s" in line and "chose " in line
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["comm"] == "auto" and line.rstrip().endswith(f"chose {result['comm_choice']} (target <= 10%).")
