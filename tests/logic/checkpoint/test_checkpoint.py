"""Checkpoints in one process: atomic and verified storage, bad checkpoints, the full training
state round trip, the data position on another world size, and `dtrain ckpt`."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from dtrain import CheckpointError
from dtrain.checkpoint import list_checkpoints, manager, read_checkpoint, read_latest, verify
from dtrain.checkpoint.store import prune, set_latest, write_checkpoint
from dtrain.cli import main as cli_main
from dtrain.data.loader import DeviceLoader, reshard


# -- storage ---------------------------------------------------------------------------------
def _write(folder, step, payload=None):
    path = write_checkpoint(str(folder), step, {"state.pt": payload or {"objects": {"w": torch.arange(1000.0)}, "step": step}}, {})
    set_latest(str(folder), path)
    return path


def test_write_verify_latest_and_retention(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, step)
    prune(str(tmp_path), keep=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [30, 40]
    assert read_latest(str(tmp_path)).endswith("step-00000040")
    assert verify(read_latest(str(tmp_path))).ok
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary leftovers


def test_truncated_and_flipped_checkpoints_are_named(tmp_path):
    path = Path(_write(tmp_path, 1))
    state = path / "state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    v = verify(str(path))
    assert not v.ok and "state.pt" in v.problem and "truncated" in v.problem
    with pytest.raises(CheckpointError, match=r"step-00000001.*truncated"):
        read_checkpoint(str(path))
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    state.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"state.pt fails its sha256 checksum"):
        read_checkpoint(str(path))


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    # A checkpoint with a valid manifest whose payload holds an arbitrary Python object.
    path = _write(tmp_path, 1, {"objects": {}, "step": 1, "evil": Path("/etc/passwd")})
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_checkpoint(path)


def test_wrong_model_is_a_clear_error(tmp_path):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(4, 3))
    ckpt = ctx.checkpoints(str(tmp_path))
    ckpt.save(5, model=model)
    other = ctx.setup(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    with pytest.raises(CheckpointError, match=r"step-00000005 does not fit this model: missing .*0.weight.*unexpected .*weight"):
        ckpt.resume(model=other)
    wider = ctx.setup(torch.nn.Linear(4, 5))
    with pytest.raises(CheckpointError, match=r"shape mismatch weight \(3, 4\) vs \(5, 4\)"):
        ckpt.resume(model=wider)
    ctx.close()


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path, caplog):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(2, 2))
    ckpt = ctx.checkpoints(str(tmp_path), keep=3)
    ckpt.save(1, model=model)
    with torch.no_grad():
        model.original.weight.add_(1.0)
    ckpt.save(2, model=model)
    state = tmp_path / "step-00000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    caplog.set_level("WARNING", logger="dtrain")
    meta = ckpt.resume(model=model)
    assert meta["step"] == 1
    assert "skipping checkpoint" in caplog.text and "step-00000002" in caplog.text
    ctx.close()


def test_async_save_reports_blocking_time_and_writes(tmp_path, monkeypatch):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(64, 64))
    ckpt = ctx.checkpoints(str(tmp_path), async_save=True)
    gate = threading.Event()  # holds step 3's write until save() has returned
    monkeypatch.setattr(manager, "write_checkpoint", lambda *a, **k: (gate.wait(60), write_checkpoint(*a, **k))[1])
    ckpt.save(3, model=model)
    first = model.original.weight.detach().clone()
    # save() returned while its write waits: what it blocked for is the snapshot alone, the write's total is to come.
    assert isinstance(ckpt.last_blocking_s, float) and ckpt.last_total_s is None
    assert not (tmp_path / "step-00000003").exists()
    gate.set()
    with torch.no_grad():
        model.original.weight.add_(1.0)  # training goes on while step 3 is written
    ckpt.save(4, model=model)  # reuses step 3's host copy once step 3 is written
    with torch.no_grad():
        model.original.weight.add_(1.0)
    ckpt.wait()
    assert verify(str(tmp_path / "step-00000004")).ok and ckpt.last_total_s >= ckpt.last_blocking_s
    assert torch.equal(read_checkpoint(str(tmp_path / "step-00000003"))["objects"]["model"]["weight"], first)
    assert torch.equal(read_checkpoint(str(tmp_path / "step-00000004"))["objects"]["model"]["weight"], first + 1)
    ctx.close()


# -- data position ---------------------------------------------------------------------------
def _loaders(n: int, world: int, batch: int) -> list[DeviceLoader]:
    data = TensorDataset(torch.arange(n))
    return [
        DeviceLoader(reshard(DataLoader(data, batch_size=batch, shuffle=True), rank=r, world_size=world, seed=3),
                     torch.device("cpu"), on_last=lambda _: None, world_size=world)
        for r in range(world)
    ]


@pytest.mark.parametrize("before, after, steps", [(2, 1, 5), (1, 2, 5), (2, 3, 6), (2, 3, 5)])
def test_resume_on_another_world_size_uses_each_sample_once(before, after, steps):
    n, batch = 96, 4
    seen: list[int] = []
    first = _loaders(n, before, batch)
    its = [iter(loader) for loader in first]
    for _ in range(steps):
        for it in its:
            seen += next(it)[0].tolist()
    state = first[0].state_dict()
    assert state == {"epoch": 0, "samples_consumed": steps * batch * before, "seed": 3}
    second = _loaders(n, after, batch)
    for loader in second:
        loader.load_state_dict(state)
        for (x,) in loader:
            seen += x.tolist()
    remaining = n - steps * batch * before
    pad = -remaining % after  # ranks must run equal steps: the remainder is padded, as every epoch's is
    assert sorted(set(seen)) == list(range(n))  # nothing skipped
    assert len(seen) == n + pad  # nothing repeated but the padding (none when the remainder divides)
    assert second[0].state_dict()["epoch"] == 1  # and the next pass is the next epoch


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(2, 2))
    ckpt = ctx.checkpoints(str(tmp_path))
    ckpt.save(1, model=model)
    (tmp_path / "step-00000001" / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"holds 1 checkpoint\(s\) and none is valid .*state.pt has 0 bytes"):
        ckpt.resume(model=model)
    ctx.close()


# -- the full training state, in one process -------------------------------------------------
class _CommStrategy:
    """The single strategy plus a communication state (as an error-feedback compressor has)."""

    def __init__(self, inner):
        self._inner, self.name, self.residual = inner, inner.name, torch.zeros(3)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def state_dict(self):
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state):
        self.residual = state["residual"].clone()


def _job(ctx):
    """Model with dropout, Adam, a schedule and a sharded loader: every part of the state matters."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt = ctx.setup(net, opt)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 2, (40,), generator=g))
    return model, opt, sched, ctx.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))


def _steps(ctx, model, opt, sched, loader, n):
    done = 0
    while done < n:
        for x, y in loader:
            ctx.backward(torch.nn.functional.cross_entropy(model(x), y) + torch.rand(()) * 0)  # draws from the RNG
            opt.step()
            opt.zero_grad()
            sched.step()
            ctx.strategy.residual += float(torch.rand(()))  # per-rank state that evolves
            done += 1
            if done == n:
                return


def test_full_state_round_trip_continues_bit_for_bit(tmp_path):
    ctx = dtrain.init("single", seed=0)
    ctx.strategy = _CommStrategy(ctx.strategy)
    job = _job(ctx)
    _steps(ctx, *job, 17)  # 10 steps an epoch: ends inside epoch 1
    expected = [p.detach().clone() for p in job[0].parameters()], job[2].get_last_lr(), ctx.strategy.residual.clone()

    ctx.strategy.residual.zero_()
    job = _job(ctx)
    _steps(ctx, *job, 12)
    ckpt = ctx.checkpoints(str(tmp_path))
    ckpt.save(12, model=job[0], optimizer=job[1], scheduler=job[2], loader=job[3], extra={"best": 0.5})
    ctx.strategy.residual.zero_()
    job = _job(ctx)  # fresh objects; the global RNG has moved on
    torch.rand(100)
    meta = ckpt.resume(model=job[0], optimizer=job[1], scheduler=job[2], loader=job[3])
    assert meta["step"] == 12 and meta["extra"] == {"best": 0.5}
    assert job[3].next_epoch == 1 and job[3].sampler.start == 8  # 2 of epoch 1's 10 batches were done
    _steps(ctx, *job, 5)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], job[0].parameters()))
    assert job[2].get_last_lr() == expected[1] and torch.equal(ctx.strategy.residual, expected[2])
    ctx.close()


# -- dtrain ckpt -----------------------------------------------------------------------------
def _ckpt(capsys, *args):
    code = cli_main(["ckpt", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ckpt_ls_verify_diff(tmp_path, capsys):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(3, 2))
    a, b = ctx.checkpoints(str(tmp_path / "a")), ctx.checkpoints(str(tmp_path / "b"))
    a.save(1, model=model)
    b.save(1, model=model)
    with torch.no_grad():
        model.original.bias[1] += 0.25
    b.save(2, model=model)
    ctx.close()
    code, out, _ = _ckpt(capsys, "diff", tmp_path / "a", tmp_path / "b" / "step-00000001")
    assert code == 0 and "identical" in out, out
    code, out, _ = _ckpt(capsys, "diff", tmp_path / "a", tmp_path / "b", "--only", "model")  # b: its latest, step 2
    assert code == 1 and "bias: max |diff| 0.25" in out and "weight" not in out, out
    code, out, _ = _ckpt(capsys, "ls", tmp_path / "b")
    assert code == 0 and "step-00000002 <- latest" in out and out.count("valid") == 2, out
    (tmp_path / "b" / "step-00000001" / "manifest.json").unlink()
    code, out, _ = _ckpt(capsys, "verify", tmp_path / "b")
    assert code == 1 and "FAIL" in out and "manifest.json is missing" in out, out
    code, _, err = _ckpt(capsys, "diff", tmp_path / "a", tmp_path / "nope")
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
