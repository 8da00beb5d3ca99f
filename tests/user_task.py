"""A user's own task, as `--task tests.user_task:make` would load it."""

import os

import torch
from torch.utils.data import TensorDataset


def make(hidden: int = 16, data_dir=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = (x.sum(1) > 0).long()
    return {
        "build_model": lambda: torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)),
        "train_set": TensorDataset(x[:200], y[:200]),
        "test_set": TensorDataset(x[200:], y[200:]),
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 16,
        "epochs": 3,
    }


def make_dropout(data_dir=None):
    """A task whose model uses dropout, so a resume is exact only if RNG states are restored."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(320, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return {
        "build_model": lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        ),
        "train_set": TensorDataset(x[:256], y[:256]),
        "test_set": TensorDataset(x[256:], y[256:]),
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 16,
        "epochs": 2,
    }


class LoggedDataset(TensorDataset):
    """Appends every index it serves to ``log_dir/<pid>.txt``: which samples training used."""

    def __init__(self, log_dir, *tensors):
        super().__init__(*tensors)
        self.log_dir = log_dir

    def __getitem__(self, index):
        with open(os.path.join(self.log_dir, f"{os.getpid()}.txt"), "a") as fh:
            fh.write(f"{int(index)}\n")
        return super().__getitem__(index)


def make_logged(log_dir, data_dir=None):
    """``make_dropout``, with a training set that logs the samples it serves (to check exactly-once)."""
    task = make_dropout()
    return {**task, "train_set": LoggedDataset(log_dir, *task["train_set"].tensors)}


class SlowDataset(TensorDataset):
    """A TensorDataset that takes ``delay`` seconds per sample: training that lasts long enough to
    lose and add nodes while it runs."""

    def __init__(self, delay, *tensors):
        super().__init__(*tensors)
        self.delay = delay

    def __getitem__(self, index):
        import time

        time.sleep(self.delay)
        return super().__getitem__(index)


def make_slow(delay="0.002", epochs="6", data_dir=None):
    """``make_dropout`` at ``delay`` seconds per sample (16 per batch), for elastic tests."""
    task = make_dropout()
    return {**task, "train_set": SlowDataset(float(delay), *task["train_set"].tensors), "epochs": int(epochs)}


class PacedDataset(TensorDataset):
    """A TensorDataset whose every sample takes the seconds written in ``pace_file`` (0 when the
    file is missing), re-read at most every 0.2 s: a test holds an elastic job at a slow pace
    while nodes leave and join, then lets it finish fast."""

    def __init__(self, pace_file, *tensors):
        super().__init__(*tensors)
        self.pace_file = pace_file
        self._pace, self._read_at = 0.0, 0.0

    def __getitem__(self, index):
        import time

        now = time.monotonic()
        if now - self._read_at > 0.2:
            try:
                with open(self.pace_file) as fh:
                    self._pace = float(fh.read() or 0)
            except (OSError, ValueError):
                self._pace = 0.0
            self._read_at = now
        if self._pace:
            time.sleep(self._pace)
        return super().__getitem__(index)


class _Padded(torch.nn.Sequential):
    """``make_dropout``'s model with a frozen parameter of ``pad_mb`` MiB: it adds nothing to a
    step (DDP reduces no gradient for it and broadcasts it once) but makes each checkpoint save
    take long enough for a test to act while one is being written."""

    def __init__(self, pad_mb, *layers):
        super().__init__(*layers)
        self.pad = torch.nn.Parameter(torch.zeros(int(pad_mb * 2**20) // 4), requires_grad=False)


def make_paced(pace_file, epochs="12", pad_mb="0", data_dir=None):
    """``make_dropout`` with a training set paced by ``pace_file`` (seconds per sample) and, with
    ``pad_mb``, slow checkpoint saves; for the elastic tests on the network test bed."""
    task = make_dropout()
    build = task["build_model"]
    return {**task, "train_set": PacedDataset(pace_file, *task["train_set"].tensors), "epochs": int(epochs),
            "build_model": (lambda: _Padded(float(pad_mb), *build())) if float(pad_mb) else build}
