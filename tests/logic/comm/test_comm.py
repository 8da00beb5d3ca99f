"""--comm: parsing and auto's rule (tier 1); every method against plain DDP on 2 ranks, local SGD's
averaging, the communication state through a checkpoint, and the CLI (tier 2, gloo)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtrain import ConfigError, strategies
from dtrain.comm import CommSpec, LinkMeasurement, choose
from dtrain.comm.methods import powersgd_numel


# -- tier 1: no process group ----------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    (None, CommSpec()),
    ("none", CommSpec(kind="none")),
    ("FP16", CommSpec(kind="fp16")),
    ("powersgd", CommSpec(kind="powersgd", rank=2)),
    ("powersgd:4", CommSpec(kind="powersgd", rank=4)),
    ("localsgd:8", CommSpec(kind="localsgd", period=8)),
    ("auto", CommSpec(kind="auto")),
])
def test_parse(text, expected):
    assert CommSpec.parse(text) == expected
    assert CommSpec.parse(str(expected)) == expected  # str() round-trips


@pytest.mark.parametrize(("text", "warmup", "message"), [
    ("zip", None, "unknown --comm 'zip'; choose one of: none, fp16"),
    ("powersgd:0", None, "the rank must be an integer >= 1"),
    ("localsgd:x", None, "the period H must be an integer >= 1"),
    ("fp16:2", None, "--comm fp16 takes no argument"),
    ("powersgd", 1, "--comm-warmup 1 is too short for powersgd"),
    ("localsgd", -1, "--comm-warmup must be >= 0"),
])
def test_parse_errors_are_one_line(text, warmup, message):
    with pytest.raises(ConfigError, match=None) as err:
        CommSpec.parse(text, warmup=warmup)
    assert message in str(err.value) and "\n" not in str(err.value)


def _link(compute_ms: float, allreduce_ms: float, latency_ms: float = 0.2) -> LinkMeasurement:
    shapes = [torch.Size([128, 9216]), torch.Size([128]), torch.Size([10, 128])]
    return LinkMeasurement(compute_ms=compute_ms, allreduce_ms=allreduce_ms, latency_ms=latency_ms,
                           grad_bytes=sum(s.numel() for s in shapes) * 4,
                           powersgd_numel={r: sum(powersgd_numel(shapes, r)) for r in (1, 2, 4)})


def test_auto_keeps_plain_allreduce_on_a_fast_link():
    choice, fractions = choose(_link(compute_ms=100, allreduce_ms=5))
    assert choice == "none" and fractions["none"] == pytest.approx(0.05)


def test_auto_compresses_on_a_slow_link_and_averages_rarely_on_a_very_slow_one():
    choice, fractions = choose(_link(compute_ms=70, allreduce_ms=400))  # ~100 Mbit/s for 4.7 MB
    assert choice.startswith("powersgd") and fractions[choice] <= 0.10
    assert fractions["none"] > 5 and fractions["bf16"] == pytest.approx(fractions["none"] / 2, rel=0.01)
    # A long-latency link: PowerSGD's three all-reduces per step cost more than rare averages.
    choice, fractions = choose(_link(compute_ms=100, allreduce_ms=400, latency_ms=5))
    assert choice.startswith("localsgd") and fractions[choice] <= 0.10


def test_auto_counts_powersgd_as_measured_not_only_its_bytes():
    by_bytes = _link(compute_ms=70, allreduce_ms=400)
    _, predicted = choose(by_bytes)
    # The warm-up's PowerSGD steps took 4x what their bytes predict (compression is compute too).
    measured = dataclasses.replace(by_bytes, powersgd_ms=4 * by_bytes.predicted_ms("powersgd:4"))
    choice, fractions = choose(measured)
    assert fractions["powersgd:4"] == pytest.approx(4 * predicted["powersgd:4"])
    for rank in (2, 1):  # the other ranks scale with their bytes from the measured one
        assert fractions[f"powersgd:{rank}"] == pytest.approx(4 * predicted[f"powersgd:{rank}"])
    assert choice != "powersgd:4" and fractions[choice] <= 0.10
    assert fractions["none"] == predicted["none"] and fractions["localsgd:16"] == predicted["localsgd:16"]


def test_powersgd_numel_follows_torch_rule():
    compressed, plain = powersgd_numel([torch.Size([128, 9216]), torch.Size([128])], 2)
    assert compressed == 2 * (128 + 9216) and plain == 128  # P and Q of the matrix; the bias as is


def test_comm_needs_ddp():
    with pytest.raises(ConfigError, match="works with the ddp strategy"):
        strategies.comm_options("dp", CommSpec.parse("fp16"), distributed=True)
    assert strategies.comm_options("single", CommSpec.parse("fp16"), distributed=False) == {}  # one process: a note


@pytest.mark.parametrize("comm, expected", [
    ("none", (64 * 32 + 32 + 32 * 10 + 10) * 4),
    ("bf16", (64 * 32 + 32 + 32 * 10 + 10) * 2),
    # by hand: weight 32x64 -> P+Q 2 x (32 + 64) = 192; weight 10x32 -> 2 x (10 + 32) = 84; biases whole 32 + 10; fp32
    ("powersgd:2", (192 + 84 + 42) * 4),
    ("localsgd:4", (64 * 32 + 32 + 32 * 10 + 10) * 4 // 4),
    ("auto", (64 * 32 + 32 + 32 * 10 + 10) * 4),  # until it has chosen
])
def test_the_bytes_reported_per_step_are_what_the_comm_method_sends(comm, expected):
    from dtrain.strategies.ddp import DDPConfig, DDPReplicas

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 10))
    replicas = DDPReplicas(DDPConfig(comm=CommSpec.parse(comm)))
    assert replicas.payload_bytes(model) == expected
    if comm == "auto":  # once it has chosen: what it chose sends
        replicas.comm = type("Chosen", (), {"choice": "localsgd:8"})()
        assert replicas.payload_bytes(model) == (64 * 32 + 32 + 32 * 10 + 10) * 4 // 8
