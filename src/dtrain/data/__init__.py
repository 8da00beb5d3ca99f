"""Sharding samplers, the device-moving loader wrapper and dataset readers."""

from .idx import read_idx
from .loader import default_num_workers, loader_options
from .sampler import EvalShardSampler, ShardSampler

__all__ = ["EvalShardSampler", "ShardSampler", "default_num_workers", "loader_options", "read_idx"]
