"""TensorBoard event files, written by the ``tensorboard`` package's own writer (through
``torch.utils.tensorboard``; the ``tensorboard`` extra)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

SCALARS = {"train_loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s", "tokens_per_s": "train/tokens_per_s",
           "data_wait_ms": "train/data_wait_ms", "comm_bytes_per_step": "comm/bytes_per_step", "mfu": "train/mfu",
           "achieved_tflops": "train/achieved_tflops"}
"""Keys of a metrics record and their TensorBoard tags."""


def check_tensorboard(logdir: str) -> None:
    """Fail before training when the writer cannot exist: a file in the way, no package."""
    import importlib.util
    import os

    from .._check import output_dir

    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ConfigError(f"--tensorboard {logdir} is a file; give a folder for the event files.")
    output_dir("--tensorboard", logdir)  # under a file, or where nothing can be written (/proc)
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard {logdir} needs the tensorboard package; pip install 'dtrain[tensorboard]' (or tensorboard).")


class TensorBoardSink:
    """Writes metrics records as scalars: the loop's figures under ``train/``, each rank's under
    ``breakdown/PHASE_ms/rankR`` and ``memory/peak_mib/rankR``."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"--tensorboard {logdir} needs the tensorboard package; pip install 'dtrain[tensorboard]' (or tensorboard).") from None
        self._w = SummaryWriter(log_dir=logdir)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                self._w.add_scalar(tag, value, step)
        for rank, window in enumerate(record.get("breakdown") or []):
            if window is None:
                continue
            for phase, ms in window["median_ms"].items():
                if ms is not None:  # None: not measured (pipeline's forward/backward/comm)
                    self._w.add_scalar(f"breakdown/{phase}_ms/rank{rank}", ms, step)
        for rank, mib in enumerate(record.get("peak_mib") or []):
            if mib is not None:
                self._w.add_scalar(f"memory/peak_mib/rank{rank}", mib, step)
        for s in record.get("stragglers") or []:
            self._w.add_text("stragglers", s["line"], step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()
