"""Horovod Elastic on dtrain (``hvd.elastic``): the sampler's re-split, and a Horovod-style
script that survives a killed worker with every sample of each epoch trained on once and the
same weights as a run without the kill."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.paths import TESTS
from tests.support import run_cli

SCRIPT = TESTS / "scripts" / "hvd_elastic.py"


def _replay(steps: list, samples: int, lr: float, size: int) -> torch.nn.Linear:
    """The same training in one process, without a kill: each step the mean gradient over the
    ranks' batches (equal sizes: the gradient of the mean over all of them)."""
    torch.manual_seed(0)
    features = torch.randn(samples, 8)
    targets = features.sum(1, keepdim=True)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr * size, momentum=0.9)
    for _, index in steps:
        opt.zero_grad()
        idx = torch.tensor(index)
        torch.nn.functional.mse_loss(model(features[idx]), targets[idx]).backward()
        opt.step()
    return model


@pytest.mark.slow  # two starts of 2 workers: ~30 s on an idle 2-core machine
@pytest.mark.timeout(300)
def test_killed_worker_resumes_from_the_last_commit(tmp_path):
    out = tmp_path / "out.json"
    r = run_cli(["run", "-n", "2", "--max-restarts", "1", str(SCRIPT), str(out), "--kill", "1:5"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0 stops at commit 5: a collective failed" in r.stderr
    assert "rank 0 resumes from commit 5" in r.stderr
    res = json.loads(out.read_text())
    assert res["resets"] == 1 and res["size"] == 2  # this process started from a commit
    for epoch in (0, 1):
        counts = Counter(i for e, index in res["steps"] if e == epoch for i in index)
        assert sorted(counts) == list(range(64)) and set(counts.values()) == {1}, counts
    model = _replay(res["steps"], 64, 0.01, 2)
    assert torch.allclose(model.weight.flatten(), torch.tensor(res["weight"]), atol=1e-5)
    assert abs(model.bias.item() - res["bias"]) < 1e-5
