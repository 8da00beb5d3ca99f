"""Sharded data parallel (zero1, fsdp) and pipeline parallel against single-process training.

Tier 1: plain logic (wrap policies, stage bounds). Tier 2: 2 ranks on gloo, each with a timeout.
"""

from __future__ import annotations

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.parallel.fsdp import units
from dtrain.parallel.pipeline import PipelineConfig, stage_bounds
from dtrain.strategies import build


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


# -- tier 1 ---------------------------------------------------------------------------------------
def test_fsdp_wrap_policies():
    model = _model()
    assert units(model, "none") == []
    assert [type(m).__name__ for m in units(model, "Linear")] == ["Linear"] * 3
    assert units(model, "size:1000") == [model[2]]  # 32*32+32 parameters; the other Linears are smaller
    with pytest.raises(ConfigError, match="no such module"):
        units(model, "Block")
    with pytest.raises(ConfigError, match="positive parameter count"):
        build("fsdp", wrap="size:abc")


def test_pipeline_stage_bounds():
    model = _model()
    assert stage_bounds(model, 2, ("3",)) == [(0, 3), (3, 5)]
    assert stage_bounds(model, 2, None) == [(0, 3), (3, 5)]  # balanced by parameter count
    with pytest.raises(ConfigError, match="not layers"):
        stage_bounds(model, 2, ("9",))
    with pytest.raises(ConfigError, match="schedule"):
        PipelineConfig(schedule="zigzag")


def test_memory_report_counts_params_grads_and_adam_state():
    from dtrain.metrics.memory import memory_report

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    report = memory_report(model, [opt], torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters()) * 4
    assert (report.params_bytes, report.grads_bytes, report.optimizer_bytes) == (n, 0, 0)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    report = memory_report(model, [opt], torch.device("cpu"))
    steps = 4 * len(list(model.parameters()))  # Adam's per-tensor step counters (fp32 scalars)
    assert (report.params_bytes, report.grads_bytes, report.optimizer_bytes) == (n, n, 2 * n + steps)
    assert report.peak_bytes > 0 and "optimizer" in report.line()


def test_pipeline_needs_a_sequential_model():
    from dtrain.world import World

    with pytest.raises(ConfigError, match="not an nn.Sequential"):
        build("pipeline").setup_model(torch.nn.Linear(2, 2), World.detect(device="cpu"))
