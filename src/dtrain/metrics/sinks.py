"""Where training figures go: a progress display on rank 0, and JSON lines in a file."""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

from .throughput import progress_fields


class JsonlSink:
    """Appends one JSON object per call to a file (flushed at once, so a crash loses nothing)."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self._fh: IO[str] = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class ProgressSink:
    """A rich progress bar on a terminal; plain periodic lines (to stderr) otherwise."""

    def __init__(self, total: int, *, start: int = 0, description: str = "train", stream: IO[str] | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self._bar = None
        if self.stream.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:
                pass
            else:
                from rich.console import Console

                self._bar = Progress(
                    TextColumn("[bold]{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"),
                    TimeRemainingColumn(),
                    console=Console(file=self.stream),
                )
                self._task = self._bar.add_task(description, total=total, completed=start, status="")
                self._bar.start()

    def update(self, step: int, fields: dict[str, Any]) -> None:
        status = progress_fields(fields)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        else:
            print(f"step {step}/{self.total}  {status}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

