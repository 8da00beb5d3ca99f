"""FSDP's mixed-precision policy as values: the policy for each precision and ``--fsdp-reduce``, the
flag's checks, and the plan's all-gather bytes following the policy. The policy at work on 2 ranks:
tests/multiprocess/parallel/test_fsdp_precision.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from dtrain.cli.sharding import add_sharding_args, strategy_options
from dtrain.errors import ConfigError
from dtrain.parallel.fsdp import FSDPConfig, mixed_precision
from dtrain.plan.model import ASSUMPTIONS, fsdp_param_bytes


def test_policy_gathers_in_the_16_bit_type_and_reduces_in_fp32_by_default():
    policy = mixed_precision(torch.bfloat16, FSDPConfig())
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = mixed_precision(torch.float16, FSDPConfig(reduce_dtype="fp16"))
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float16)
    plain = mixed_precision(None, FSDPConfig())  # fp32: nothing cast
    assert (plain.param_dtype, plain.reduce_dtype) == (None, None)
    compressed = mixed_precision(None, FSDPConfig(reduce_dtype="bf16"))  # fp32 training, bf16 gradients on the wire
    assert (compressed.param_dtype, compressed.reduce_dtype) == (None, torch.bfloat16)


def test_reduce_dtype_is_checked_where_it_is_defined():
    with pytest.raises(ConfigError, match=r"--fsdp-reduce 'int8' is not a reduce dtype; choose one of: fp32, bf16, fp16"):
        FSDPConfig(reduce_dtype="int8")


def _options(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="auto")
    p.add_argument("--parallel", default=None)
    add_sharding_args(p)
    return strategy_options(p.parse_args(list(argv)))


def test_the_flag_reaches_fsdp_hsdp_and_dp_shard_layouts_only():
    assert _options("--strategy", "fsdp", "--fsdp-reduce", "bf16") == {"reduce_dtype": "bf16"}
    assert _options("--strategy", "hsdp", "--fsdp-reduce", "fp32") == {"reduce_dtype": "fp32"}
    assert _options("--parallel", "dp_shard=2,tp=2", "--fsdp-reduce", "bf16") == {"reduce_dtype": "bf16"}
    with pytest.raises(ConfigError, match="--fsdp-reduce applies to --strategy fsdp or hsdp, not 'ddp'"):
        _options("--strategy", "ddp", "--fsdp-reduce", "bf16")


def test_layout_takes_reduce_dtype():
    from dtrain import strategies

    strat = strategies.build("composed", parallel="dp_shard=2", reduce_dtype="bf16")
    assert strat.fsdp.reduce_dtype == "bf16"


def test_plan_gathers_bytes_of_the_policy():
    assert fsdp_param_bytes("bf16-mixed") == fsdp_param_bytes("fp16-mixed") == 2
    assert fsdp_param_bytes("fp32") == 4
    text = " ".join(ASSUMPTIONS)
    assert "dtrain sets no mixed-precision policy" not in text and "16-bit type under bf16-/fp16-mixed" in text
