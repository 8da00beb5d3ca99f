"""Sharding samplers, the device-moving loader wrapper and dataset readers."""

from .idx import read_idx
from .ledger import SampleLedger, check_ledger
from .loader import default_num_workers, loader_options, usable_cores
from .sampler import EvalShardSampler, ShardSampler

__all__ = ["EvalShardSampler", "SampleLedger", "ShardSampler", "check_ledger", "default_num_workers", "loader_options", "read_idx", "usable_cores"]
