"""What one rank is doing: a heartbeat per step and a ring buffer of its recent collectives, read
by the watchdog thread. Only a rank *armed* by the first heartbeat or collective can declare a
stall, so loading data or building a model may take any time."""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../dtrain
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass
class CollectiveCall:
    seq: int
    op: str
    shapes: str
    site: str
    started: float
    ended: float | None = None

    def describe(self) -> str:
        return f"{self.op} #{self.seq} " + (f"{self.shapes} " if self.shapes else "") + f"at {self.site}"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def describe_tensors(*tensors: Any) -> str:
    """``float32[3, 2], [int64[1]]``: dtypes and shapes, as the checker compares and reports them."""
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            name = _DTYPE_NAMES.get(t.dtype) or _DTYPE_NAMES.setdefault(t.dtype, str(t.dtype).removeprefix("torch."))
            parts.append(f"{name}{list(t.shape)}")
        elif isinstance(t, (list, tuple)):
            parts.append("[" + describe_tensors(*t) + "]")
        elif t is not None:
            parts.append(type(t).__name__)
    return ", ".join(parts)


@functools.lru_cache(maxsize=4096)
def _kind(filename: str) -> int:
    """0: the user's own code; 1: an installed package's; 2: dtrain's, torch's, the standard library's."""
    if filename.startswith("<"):
        return 2
    path = os.path.abspath(filename)
    if path.startswith((_PKG + os.sep, _TORCH + os.sep)):
        return 2
    if "site-packages" in path or "dist-packages" in path:
        return 1
    return 2 if "/lib/python" in path else 0


def user_site(frame: FrameType | None = None) -> str:
    """``file:line`` of the innermost frame of the user's code: their scripts first, else an
    installed package's (a library they train with), else the innermost frame."""
    f = frame if frame is not None else sys._getframe(1)
    best, best_kind = f, 3
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind == 0:
            best = f
            break
        if kind < best_kind:
            best, best_kind = f, kind
        f = f.f_back
    return f"{os.path.basename(best.f_code.co_filename)}:{best.f_lineno}" if best is not None else "?"


class Tracker:
    """Heartbeat and collective history of this rank."""

    def __init__(self, history: int = 64) -> None:
        self.step = 0
        self.armed = False
        self.last_beat = time.monotonic()
        self.seq = 0
        self.current: CollectiveCall | None = None
        self.recent: collections.deque[CollectiveCall] = collections.deque(maxlen=history)
        self.main_thread = threading.main_thread()

    def beat(self, step: int | None = None) -> None:
        self.last_beat = time.monotonic()
        self.armed = True
        if step is not None:
            self.step = step

    def enter(self, op: str, *tensors: Any) -> CollectiveCall:
        self.seq += 1
        call = CollectiveCall(self.seq, op, describe_tensors(*tensors), user_site(sys._getframe(1)), time.monotonic())
        self.current = call
        self.recent.append(call)
        self.last_beat = call.started
        self.armed = True
        return call

    def leave(self, call: CollectiveCall) -> None:
        call.ended = time.monotonic()
        self.last_beat = call.ended
        if self.current is call:
            self.current = None

    # -- reports ----------------------------------------------------------------------------
    def main_frame(self) -> FrameType | None:
        return sys._current_frames().get(self.main_thread.ident)

    def snapshot(self, rank: int) -> dict[str, Any]:
        """What this rank is doing now, for the merged stall report."""
        frame = self.main_frame()
        where = user_site(frame) if frame is not None else "?"
        inner = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})" if frame else "?"
        in_backward = _in_function(frame, "backward")
        last_done = next((c for c in reversed(self.recent) if c.ended is not None), None)
        return {
            "rank": rank, "step": self.step, "idle_s": round(time.monotonic() - self.last_beat, 1), "at": where,
            "innermost": inner, "in_backward": in_backward,
            "current": self.current.describe() if self.current else None,
            "current_seq": self.current.seq if self.current else None,
            "last_done_seq": last_done.seq if last_done else 0,
        }

    def dump(self, rank: int) -> str:
        """Every thread's Python stack and the recent collectives, as text."""
        lines = [f"# rank {rank}, pid {os.getpid()}, step {self.step}, idle {time.monotonic() - self.last_beat:.1f} s", ""]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"## thread {names.get(ident, ident)}")
            lines.extend(line.rstrip() for line in traceback.format_stack(frame))
            lines.append("")
        lines.append("## recent collectives (oldest first)")
        for c in self.recent:
            state = "in progress" if c.ended is None else f"{(c.ended - c.started) * 1e3:.1f} ms"
            lines.append(f"{c.describe()}  [{state}]")
        return "\n".join(lines) + "\n"


def _in_function(frame: FrameType | None, name: str) -> bool:
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False
