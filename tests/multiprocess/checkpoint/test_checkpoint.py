"""Checkpoints in one process: atomic and verified storage, bad checkpoints, the full training
state round trip, the data position on another world size, and `dtrain ckpt`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dtrain
from dtrain.checkpoint import list_checkpoints, read_checkpoint, read_latest, verify
from tests.paths import ROOT

SAVER = textwrap.dedent(
    """
    import sys, torch, dtrain
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(2048, 2048))
    ckpt = ctx.checkpoints(sys.argv[1], keep=100, async_save=sys.argv[2] == "async")
    ckpt.save(1, model=model)
    ckpt.wait()
    print("first", flush=True)
    step = 2
    while True:
        ckpt.save(step, model=model)
        step += 1
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path, mode):
    folder = tmp_path / "ck"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, str(script), str(folder), mode], stdout=subprocess.PIPE, text=True, env=env)
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
    assert any(p.startswith(".tmp-") for p in os.listdir(folder))  # the kill did land inside a save
    for _, path in list_checkpoints(str(folder)):
        assert verify(path).ok, path  # no torn checkpoint was ever renamed into place
    latest = read_latest(str(folder))
    assert verify(latest).ok
    state = read_checkpoint(latest)
    assert state["objects"]["model"]["weight"].shape == (2048, 2048)
    ctx = dtrain.init("single")  # the next run's first save removes the torn leftovers
    ctx.checkpoints(str(folder), keep=100).save(10**6, model=ctx.setup(torch.nn.Linear(2, 2)))
    ctx.close()
    assert not [p for p in os.listdir(folder) if p.startswith(".")]
