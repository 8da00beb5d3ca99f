"""Benchmark-only: DDP's gradient bucket size for every DistributedDataParallel a process builds
(``benchmarks/batch_split.py --bucket-mb``), to measure how much of the all-reduce a smaller last
bucket moves into backward on throttled cores. Python imports this at start-up when this folder is
on PYTHONPATH (the bench puts it there for the bed's launchers, whose workers inherit it); it does
nothing unless ``BATCH_SPLIT_BENCH_BUCKET_MB`` is set. dtrain itself has no such setting."""

import os

_MB = os.environ.get("BATCH_SPLIT_BENCH_BUCKET_MB")
if _MB:
    import functools

    import torch.nn.parallel.distributed as _ddp

    _init = _ddp.DistributedDataParallel.__init__

    @functools.wraps(_init)
    def _sized(self, *args, **kwargs):  # every caller in dtrain passes bucket_cap_mb by keyword
        kwargs["bucket_cap_mb"] = float(_MB)
        _init(self, *args, **kwargs)

    _ddp.DistributedDataParallel.__init__ = _sized
