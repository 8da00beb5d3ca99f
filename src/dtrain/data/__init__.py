"""Sharding samplers, the device-moving loader wrapper and dataset readers."""

from .idx import read_idx
from .sampler import EvalShardSampler, ShardSampler

__all__ = ["EvalShardSampler", "ShardSampler", "read_idx"]
