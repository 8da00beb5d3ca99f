"""The background thread that runs Horovod's collectives one at a time, in submission order, and
the handles its async API returns. Every operation starts with an ``all_gather`` of its
description, so ranks that disagree all raise the same error instead of hanging gloo.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain import DtrainError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool]
KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "reducescatter": 5, "join": 6, "barrier": 7}
MAX_DIMS = 10
WIDTH = 6 + MAX_DIMS


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank (Horovod's error type)."""


class MismatchError(HorovodInternalError):
    """Ranks submitted different operations, shapes, dtypes or roots; raised on every rank."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod Elastic: the set of workers is changing (raised by ``state.commit()``; ``hvd.elastic.run`` handles it)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of workers is changing")
        self.skip_sync = skip_sync


def as_horovod_error(exc: BaseException) -> BaseException:
    """What a failed operation raises on the caller's thread: anything but our own errors and
    ValueError (gloo's error when a peer died) as ``HorovodInternalError``."""
    if isinstance(exc, (HorovodInternalError, ValueError, DtrainError)):
        return exc
    error = HorovodInternalError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class Handle:
    """What ``*_async`` returns: ``poll(handle)``, ``synchronize(handle)``."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


def describe(kind: str, tensor: torch.Tensor | None, arg: int = 0, joined_at: int = -1) -> torch.Tensor:
    """A fixed-size int64 row that says what this rank is about to do."""
    row = torch.full((WIDTH,), -1, dtype=torch.int64)
    row[0] = KINDS[kind]
    row[3], row[4] = arg, joined_at
    if tensor is not None:
        row[1] = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else 99
        row[2] = tensor.dim()
        shape = list(tensor.shape)[:MAX_DIMS]
        row[6:6 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        row[5] = tensor.numel()
    return row


def exchange(row: torch.Tensor, group: Any, nranks: int, device: torch.device) -> torch.Tensor:
    """Every rank's row, stacked (rank order within ``group``)."""
    rows = [torch.empty(WIDTH, dtype=torch.int64, device=device) for _ in range(nranks)]
    dist.all_gather(rows, row.to(device), group=group)
    return torch.stack(rows).cpu()


class Engine:
    """One worker thread; ``submit`` queues a function and returns its ``Handle``."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Handle, Callable[[], Any]] | None] = queue.Queue()
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dtrain-horovod", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], name: str | None = None) -> Handle:
        with self._lock:
            if name is not None:
                if name in self._names:
                    raise ValueError(f"an operation named {name!r} is still in flight on this rank; "
                                     "give each concurrent operation its own name.")
                self._names.add(name)
        handle = Handle(name)
        self._queue.put((handle, fn))
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn = item
            try:
                handle.result = fn()
            except BaseException as exc:  # handed to whoever synchronizes
                handle.error = as_horovod_error(exc)
            finally:
                if handle.name is not None:
                    with self._lock:
                        self._names.discard(handle.name)
                handle.done.set()

    def drain(self) -> None:
        """Wait until every queued operation has finished."""
        self.submit(lambda: None).done.wait()

    def stop(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join(timeout=60)
