"""Checkpoints: atomic and verified storage, bad checkpoints, exact resume (same and different
world size), elastic restart after kill -9, and `dtrain ckpt`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dtrain
from dtrain import CheckpointError
from dtrain.checkpoint import list_checkpoints, read_checkpoint, read_latest, verify
from dtrain.checkpoint.store import prune, set_latest, write_checkpoint
from dtrain.data.loader import DeviceLoader, reshard
from dtrain.testing import run_cli, run_distributed

ROOT = Path(__file__).resolve().parent.parent


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


def test_async_save_reports_blocking_time_and_writes(tmp_path):
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(64, 64))
    ckpt = ctx.checkpoints(str(tmp_path), async_save=True)
    ckpt.save(3, model=model)
    assert ckpt.last_blocking_s is not None and ckpt.last_blocking_s >= 0
    ckpt.wait()
    assert verify(str(tmp_path / "step-00000003")).ok and ckpt.last_total_s >= ckpt.last_blocking_s
    ctx.close()


SAVER = textwrap.dedent(
    """
    import sys, torch, dtrain
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(2048, 2048))
    ckpt = ctx.checkpoints(sys.argv[1], keep=100)
    ckpt.save(1, model=model)
    print("first", flush=True)
    step = 2
    while True:
        ckpt.save(step, model=model)
        step += 1
    """
)


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    folder = tmp_path / "ck"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "first"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill while a save is in flight
            if any(p.startswith(".tmp-") for p in os.listdir(folder)):
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    for _, path in list_checkpoints(str(folder)):
        assert verify(path).ok, path  # no torn checkpoint was ever renamed into place
    latest = read_latest(str(folder))
    assert verify(latest).ok
    state = read_checkpoint(latest)
    assert state["objects"]["model"]["weight"].shape == (2048, 2048)


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


# -- end to end through dtrain train ---------------------------------------------------------
def _train(args, **kw):
    r = run_cli(["train", "--task", "tests.user_task:make_dropout", *args], cwd=str(ROOT), **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_clean_stop_and_resume_is_bitwise_identical(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(["-n", "2", "--checkpoint-dir", str(full)], timeout=240)
    _train(["-n", "2", "--checkpoint-dir", str(part), "--max-steps", "11"], timeout=240)  # mid-epoch 1 of 2
    resumed = _train(["-n", "2", "--checkpoint-dir", str(part), "--resume"], timeout=240)
    assert resumed["steps"] == 16
    r = run_cli(["ckpt", "diff", str(full), str(part)])
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout
    r = run_cli(["ckpt", "ls", str(part)])
    assert "step-00000016 <- latest" in r.stdout and "valid" in r.stdout


def test_kill_9_under_max_restarts_resumes_and_matches(tmp_path):
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    _train(["-n", "2", "--checkpoint-dir", str(ref)], timeout=240)
    r = run_cli(["train", "--task", "tests.user_task:make_dropout", "-n", "2", "--checkpoint-dir", str(crashed),
                 "--save-every", "3", "--max-restarts", "2"], cwd=str(ROOT), timeout=300,
                env={"DTRAIN_FAULT_INJECT": "1:10"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step-00000009" in r.stderr  # redid 1 step, not the run
    d = run_cli(["ckpt", "diff", str(ref), str(crashed)])
    assert d.returncode == 0, d.stdout


def test_resume_with_corrupt_latest_uses_previous(tmp_path):
    ck = tmp_path / "ck"
    _train(["-n", "1", "--checkpoint-dir", str(ck), "--max-steps", "8", "--save-every", "4"], timeout=240)
    state = ck / "step-00000008" / "state.pt"
    data = bytearray(state.read_bytes())
    data[100] ^= 0xFF
    state.write_bytes(bytes(data))
    v = run_cli(["ckpt", "verify", str(ck)])
    assert v.returncode == 1 and "FAIL" in v.stdout and "checksum" in v.stdout
    r = run_cli(["train", "--task", "tests.user_task:make_dropout", "-n", "1", "--checkpoint-dir", str(ck), "--resume",
                 "--max-steps", "10"], cwd=str(ROOT), timeout=240)
    assert r.returncode == 0, r.stderr
    assert "skipping checkpoint" in r.stderr and "resumed from" in r.stderr and "step-00000004" in r.stderr


def test_ckpt_diff_reports_differences_and_bad_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(["-n", "1", "--checkpoint-dir", str(a), "--max-steps", "3"], timeout=240)
    _train(["-n", "1", "--checkpoint-dir", str(b), "--max-steps", "4"], timeout=240)
    r = run_cli(["ckpt", "diff", str(a), str(b), "--only", "model"])
    assert r.returncode == 1 and "max |diff|" in r.stdout
    r = run_cli(["ckpt", "diff", str(a), str(tmp_path / "nope")])
    assert r.returncode == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
