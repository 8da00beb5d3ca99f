"""The collective checker (``dtrain.init(debug=True)``, ``--debug`` or ``DTRAIN_DEBUG=1``): before
each collective dtrain issues, every rank's call (op, shapes and dtypes, call site) is all-gathered
and compared, so a mismatch raises CollectiveMismatch on every rank instead of hanging. One small
all-gather per collective, so it is for debugging; DDP's own all-reduces (C++) are not checked."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import CollectiveMismatch
from .tracker import CollectiveCall


def _gather(value: Any, size: int) -> list[Any]:
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def check_call(world_size: int, call: CollectiveCall) -> None:
    """Collective. Raise CollectiveMismatch unless every rank makes the same call (op, shapes and
    dtypes) as this one; the call site is for the message only (``if rank == 0: ...`` is fine)."""
    mine = (call.op, call.shapes, call.site)
    calls = _gather(mine, world_size)
    if all(c[:2] == mine[:2] for c in calls):
        return
    lines = [f"  rank {r}: {op} {shapes or '(no tensor)'} at {site}" for r, (op, shapes, site) in enumerate(calls)]
    raise CollectiveMismatch(
        f"ranks disagree on collective #{call.seq} (a rank skipped or reordered a collective, or shapes differ):\n"
        + "\n".join(lines)
    )


def check_same(world_size: int, what: str, value: Any, *, fix: str) -> None:
    """Collective: call on every rank. Raise CollectiveMismatch unless ``value`` is equal on all ranks."""
    values = _gather(value, world_size)
    if all(v == values[0] for v in values):
        return
    listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    raise CollectiveMismatch(f"ranks disagree on the {what} ({listing}); {fix}.")
