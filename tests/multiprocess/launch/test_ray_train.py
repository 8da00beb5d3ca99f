"""Ray Train's TorchTrainer with dtrain inside: a train loop that calls ``dtrain.init()`` gets a
Context on the process group Ray Train made (2 CPU workers of a Ray instance started for the
test). Skipped where ray[train] is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT, TESTS
from tests.support import SRC

HAS_RAY_TRAIN = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.train") is not None


@pytest.mark.skipif(not HAS_RAY_TRAIN, reason="ray[train] is not installed (pip install 'ray[train]')")
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_dtrain_init_in_a_torchtrainer_loop_adopts_ray_trains_process_group(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (SRC, str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, str(TESTS / "scripts" / "ray_train_loop.py"), str(tmp_path)], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "RAY_TRAIN_DONE" in r.stdout, (r.stdout + r.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, got in enumerate(ranks):
        # dtrain.init did not form a group of its own: Ray Train's is the default group, world from its variables.
        assert (got["rank"], got["world"], got["sum"], got["same_group"], got["source"]) == (i, 2, 3.0, True, "torchrun"), got
    # Each rank drew other data: equal weights after 3 steps mean ctx.setup's DDP averaged the gradients.
    assert ranks[0]["weights"] == ranks[1]["weights"], ranks
