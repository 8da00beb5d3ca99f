"""Composed parallelisms (``--parallel``): ParallelDims, tensor parallelism on ``lm``, FSDP x TP,
DDP x TP, PP x DP, PP x TP and HSDP x TP against one process, checkpoints that load into another
layout.

Tier 1: the layout value and its errors, the TP plan, the norm's bookkeeping. Tier 2: 2-8 ranks on
gloo (slow on 2 cores: one run per composition, each with a timeout).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtrain import strategies
from dtrain.comm import CommSpec
from dtrain.errors import ConfigError
from dtrain.parallel import ParallelDims, parse, resolve
from dtrain.tasks.gpt import CausalSelfAttention, gpt, gpt_tp_plan
from dtrain.world import World


# -- tier 1 ---------------------------------------------------------------------------------------
def test_dims_validate_and_show_the_arithmetic():
    dims = parse("dp_shard=2,tp=2")
    assert dims == ParallelDims(dp_shard=2, tp=2) and dims.world_size == 4 and dims.dp == 2
    dims.check_world(4)
    with pytest.raises(ConfigError, match=r"dp_shard=2 x tp=2 = 4 processes, but the job has 8; .*dp_shard=4"):
        dims.check_world(8)
    with pytest.raises(ConfigError, match="whole number >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(ConfigError, match="not NAME=N"):
        parse("dp=2")
    with pytest.raises(ConfigError, match="unknown dimension"):
        resolve({"tensor": 2})
    assert resolve({"tp": 2}) == ParallelDims(tp=2)


def test_tp_ranks_read_the_same_data_and_tp_is_fastest():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.coordinates(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "tp": 1}


@pytest.mark.parametrize("layout, expected", [
    ("dp_replicate=4", "ddp"), ("dp_shard=4", "fsdp"), ("dp_replicate=2,dp_shard=2", "hsdp"),
    ("pp=4", "pipeline"), ("dp_shard=2,tp=2", "composed"), ("tp=4", "composed"),
])
def test_one_kind_layouts_are_the_named_strategies(layout, expected):
    # A layout of one way is the named strategy: the same name, layout on the world, declared
    # capabilities and settings (hsdp: shard groups of dp_shard ranks).
    world = World(rank=1, size=4, local_size=4)
    strat = strategies.build("auto", parallel=layout)
    assert strat.name == expected
    if expected != "composed":
        named = strategies.build(expected, **({"shard_size": 2} if expected == "hsdp" else {}))
        assert strat.layout(world) == named.layout(world) == parse(layout)
        assert strat.capabilities == named.capabilities
        assert strat.config == (dataclasses.replace(named.config, shard_size=None) if expected == "hsdp" else named.config)
        assert strat.data_parallel(world) == named.data_parallel(world)


def test_layout_and_strategy_together_are_one_line_and_pp_composes():
    with pytest.raises(ConfigError, match="both say how to split"):
        strategies.build("ddp", parallel="tp=2")
    with pytest.raises(ConfigError, match="drop bucket_cap_mb"):
        strategies.build("auto", parallel="tp=2", bucket_cap_mb=5)
    strat = strategies.build("auto", parallel="pp=2,dp_shard=2", microbatches=2, wrap="none")
    assert strat.name == "composed" and strat.pipeline.microbatches == 2 and strat.fsdp.wrap == "none"
    assert strat.capabilities.staged_step and strat.capabilities.sharded_params


def test_a_layout_of_replicas_alone_takes_comm_as_ddp_does():
    fp16 = CommSpec.parse("fp16")
    strat = strategies.build("auto", parallel="dp_replicate=4", comm=fp16, distributed=True)
    assert strat.config.comm == fp16 and strat.capabilities.supports_comm
    with pytest.raises(ConfigError, match="works with the ddp strategy, not 'fsdp'"):
        strategies.build("auto", parallel="dp_shard=4", comm=fp16, distributed=True)
    with pytest.raises(ConfigError, match="works with the ddp strategy, not 'composed'"):
        strategies.build("auto", parallel="dp_replicate=2,tp=2", comm=fp16, distributed=True)


def test_tp_plan_splits_each_block_the_embeddings_and_head_and_refuses_uneven_heads():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    model = gpt(vocab=64, context=8, layers=2, heads=4, width=32)
    plan = gpt_tp_plan(model, 2)
    split = sorted(n for n, s in plan.items() if isinstance(s, (ColwiseParallel, RowwiseParallel)))
    assert split == sorted(["embed.tok", "embed.pos", "head.out"] + [f"block{i}.{s}" for i in range(2)
                                                                      for s in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")])
    assert sorted(n for n, s in plan.items() if isinstance(s, SequenceParallel)) == ["block0.ln1", "block0.ln2", "block1.ln1", "block1.ln2", "head.ln"]
    with pytest.raises(ConfigError, match="heads=4 cannot be split over tp=3"):
        gpt_tp_plan(model, 3)


def test_checkpoints_with_a_fused_qkv_still_load():
    attn = CausalSelfAttention(8, 2, 0.0)
    fused = {"qkv.weight": torch.randn(24, 8), "qkv.bias": torch.randn(24),
             "proj.weight": torch.randn(8, 8), "proj.bias": torch.randn(8)}
    attn.load_state_dict(fused)
    assert torch.equal(attn.k.weight, fused["qkv.weight"][8:16]) and torch.equal(attn.v.bias, fused["qkv.bias"][16:])


def test_tp_without_a_plan_is_one_line_before_any_collective():
    from dtrain.parallel.apply import apply_layout_tp

    with pytest.raises(ConfigError, match="has no tensor-parallel plan; set Task.tp_plan"):
        apply_layout_tp(torch.nn.Linear(2, 2), ParallelDims(tp=2), None, torch.device("cpu"), None)
