"""Horovod's PyTorch API (``horovod.torch``) on top of torch.distributed.

A script written for ``horovodrun -np 2 python train.py`` runs with ``dtrain run -n 2 train.py``
after changing one line::

    import horovod.torch as hvd        ->   import dtrain.compat.horovod as hvd

Everything of ``horovod.torch`` that runs without MPI is here (docs/compat.md), and Horovod
Elastic; ranks that submit different shapes, dtypes or roots all raise instead of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import elastic
from ._basics import (
    ProcessSet,
    _unsupported,
    add_process_set,
    cross_rank,
    cross_size,
    get_process_set_ids_and_ranks,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from ._compression import Compression, Compressor
from ._engine import Handle, HorovodInternalError, HostsUpdatedInterrupt, MismatchError
from ._ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from ._optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__version__ = "0.28.1+dtrain"  # the Horovod API level this follows

SyncBatchNorm = torch.nn.SyncBatchNorm


def _no() -> bool:
    """MPI, CCL, DDL and ROCm builds: none of them here."""
    return False


mpi_threads_supported = mpi_enabled = mpi_built = ccl_built = ddl_built = rocm_built = _no


def gloo_built() -> bool:
    return dist.is_gloo_available()


gloo_enabled = gloo_built


def cuda_built() -> bool:
    return torch.cuda.is_available()


def nccl_built() -> int:
    """NCCL's version as Horovod encodes it (2.7.8 -> 2708), or 0 without GPUs."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 1000 + minor * 100 + patch


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    _unsupported("the timeline (use torch.profiler)")


def stop_timeline() -> None:
    _unsupported("the timeline (use torch.profiler)")


__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "Handle", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "MismatchError", "Product", "ProcessSet", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "get_process_set_ids_and_ranks",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
