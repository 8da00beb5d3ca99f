"""`dtrain train --parallel auto`: what it refuses (one line, before any profile), and the config it accepts."""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.cli import train_auto as auto
from dtrain.comm import CommSpec
from dtrain.errors import ConfigError
from dtrain.train.config import CheckpointConfig, ParallelConfig, TaskConfig, TrainConfig


def _cfg(**parallel) -> TrainConfig:
    return TrainConfig(task=TaskConfig(name="digits"), parallel=ParallelConfig(layout="auto", **parallel))


def test_auto_is_a_layout_the_config_takes_and_a_strategy_beside_it_is_refused():
    assert _cfg().parallel.layout == "auto"
    with pytest.raises(ConfigError, match="--parallel auto and --strategy fsdp both say how to split the ranks"):
        _cfg(strategy="fsdp")


@pytest.mark.parametrize("kw, message", [
    ({"nnodes": 1, "elastic": False, "launches": False}, "needs dtrain train to start the workers"),
])
def test_auto_refuses_what_one_plan_cannot_decide(kw, message):
    with pytest.raises(ConfigError, match=message):
        auto.refuse(_cfg(), **kw)


def test_auto_refuses_a_comm_method_and_strategy_options_it_would_override():
    with pytest.raises(ConfigError, match="--comm powersgd"):
        auto.refuse(_cfg(comm=CommSpec.parse("powersgd:2")), nnodes=1, elastic=False, launches=True)
    with pytest.raises(ConfigError, match=r"its options \(wrap\) may not apply"):
        auto.refuse(_cfg(strategy_options={"wrap": "block"}), nnodes=1, elastic=False, launches=True)
    auto.refuse(_cfg(), nnodes=1, elastic=False, launches=True)  # the plain case goes on to the plan
    auto.refuse(_cfg(), nnodes=2, elastic=False, launches=True)  # node 0 plans for every node (launch/autopick.py)
    with pytest.raises(ConfigError, match="--nnodes 1:MAX needs --checkpoint-dir"):  # before the plan, not after it
        auto.refuse(_cfg(), nnodes=1, elastic=True, launches=True)
    elastic = dataclasses.replace(_cfg(), checkpoint=CheckpointConfig(dir="ck", save_every=5))
    auto.refuse(elastic, nnodes=1, elastic=True, launches=True)  # the first node plans; the pick is kept at every size


def test_the_line_names_the_world_planned_for_on_several_nodes():
    assert auto.nodes_note(1, 4) == ""
    assert auto.nodes_note(2, 1).startswith(" Planned for 2 nodes x 1 process (world 2); every node trains this pick")
    assert "the most of --nnodes MIN:MAX, among the layouts that run at any size; kept at every size" in auto.nodes_note(2, 1, elastic=True)


def test_an_elastic_jobs_pick_is_among_the_layouts_every_size_runs():
    from dtrain import strategies

    assert [x.name for x in auto.any_size_layouts(4, 2, 2)] == ["ddp", "zero1", "fsdp", "hsdp"]
    assert [x.name for x in auto.any_size_layouts(2, 1, 2)] == ["ddp", "zero1", "fsdp"]
    # each is a strategy name, whose layout follows the world: valid at 1, 2 or 3 nodes of 2
    assert all(x.is_strategy and x.comm == "none" for x in auto.any_size_layouts(6, 2, 3))
    assert [(strategies.preset("hsdp", w, 2).dp_replicate, strategies.preset("hsdp", w, 2).dp_shard) for w in (2, 4, 6)] == \
        [(1, 2), (2, 2), (3, 2)]


def test_one_process_needs_no_plan(capsys):
    cfg = auto.resolve(_cfg(), world_size=1, nproc=1, device=None)
    assert cfg.parallel.layout is None and cfg.parallel.strategy == "auto"
    assert "one process, nothing to split" in capsys.readouterr().err


def test_cpu_is_profiled_here():
    assert auto._device_kind("cpu") == ("cpu", False)


@pytest.mark.parametrize("gpu, bf16, float8, name", [
    (False, False, False, "fp32"), (False, True, True, "fp32"),   # a CPU: fp32 whatever it emulates
    (True, False, False, "fp32"), (True, False, True, "fp32"),    # V100, P100: no bf16
    (True, True, False, "bf16-mixed"), (True, True, True, "float8"),
])
def test_auto_precision_is_one_rule(gpu, bf16, float8, name):
    from dtrain.precision import auto_name

    assert auto_name(gpu=gpu, bf16=bf16, float8=float8) == name


def test_a_gpu_name_becomes_its_preset_in_one_place_and_the_presets_know_bf16():
    from dtrain.plan.cluster import DEVICES, GIB, preset_for

    assert preset_for("NVIDIA H100 80GB HBM3", 80 * GIB) == "h100"
    assert preset_for("NVIDIA H200", 141 * GIB) == "h200"
    assert preset_for("NVIDIA A100-SXM4-40GB", 40 * GIB) == "a100-40"
    assert preset_for("NVIDIA A100-SXM4-80GB", 80 * GIB) == "a100"
    assert preset_for("Tesla V100-SXM2-32GB", 32 * GIB) == "v100"
    assert preset_for("NVIDIA GeForce RTX 4090", 24 * GIB) is None
    assert [k for k, d in DEVICES.items() if d.bf16] == ["h100", "h200", "a100", "a100-40"]


def test_the_plan_takes_each_strategys_layout_from_the_registry():
    from dtrain import strategies
    from dtrain.parallel.dims import ParallelDims
    from dtrain.plan.layouts import candidates, named

    assert strategies.preset("ddp", 16, 8) == ParallelDims(dp_replicate=16)
    assert strategies.preset("fsdp", 16, 8) == ParallelDims(dp_shard=16)
    assert strategies.preset("hsdp", 16, 8) == ParallelDims(dp_replicate=2, dp_shard=8)
    assert [(x.name, x.comm, x.zero1) for x in named("ddp", 4, 2, ("none", "bf16"))] == [("ddp", "none", False), ("ddp", "bf16", False)]
    assert [(x.name, x.comm, x.zero1) for x in named("zero1", 4, 2, ("none", "bf16"))] == [("zero1", "none", True)]  # no --comm
    by_name = {x.name: x.dims for x in candidates(16, 8, 2, blocks=4, tp_ok=False, pp_ok=False, comms=("none",))}
    assert all(by_name[n] == strategies.preset(n, 16, 8) for n in ("ddp", "zero1", "fsdp", "hsdp"))
