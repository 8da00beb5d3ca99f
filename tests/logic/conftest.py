"""The logic tier: plain functions and classes, no child process and no process group, so the
whole tier runs in seconds. A test here that starts a process (subprocess, fork, multiprocessing,
a DataLoader's workers, the CLI as a subprocess) or initialises a process group fails with the
reason: it belongs in tests/multiprocess/ (docs/testing.md, "Tiers"). The calls are refused, and
the test also fails when it catches the refusal itself (``pytest.raises(Exception)`` and the like)."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_WHERE = "a test that does belongs in tests/multiprocess/<area>/ (docs/testing.md, Tiers)"


class TierError(RuntimeError):
    """What a logic-tier test gets for starting a process or a process group."""


def _refuser(seen: list[str], what: str):
    def refuse(*args, **kwargs):
        seen.append(what)
        raise TierError(f"the logic tier starts no {what}; {_WHERE}")

    return refuse


def _popen_refuser(seen: list[str]):
    def refuse(self, args, *rest, **kwargs):
        what = f"child process ({args if isinstance(args, str) else ' '.join(map(str, args))[:120]})"
        seen.append(what)
        raise TierError(f"the logic tier starts no {what}; {_WHERE}")

    return refuse


@pytest.fixture(autouse=True, scope="session")
def _font_cache():
    """matplotlib lists the machine's fonts with ``fc-list`` (a child process) the first time it is
    imported on a machine, then caches them: done once here, before any test's guard, so that
    `dtrain report`'s tests stay in this tier on a fresh machine too."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _logic_tier(monkeypatch):
    seen: list[str] = []
    # Popen's one way to a child: subprocess.run/check_output/os.popen and `from subprocess import Popen` all pass here.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _popen_refuser(seen))
    # Not os.system: crafted-checkpoint tests pickle it by reference as the payload, and a stand-in does not
    # pickle. A command run through os.system is the one way past this fixture.
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuser(seen, f"child process (os.{name})"))
    # Every multiprocessing context (fork, spawn, forkserver; torch.multiprocessing, DataLoader workers,
    # process pools) starts its processes here.
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuser(seen, "child process (multiprocessing)"))
    group = _refuser(seen, "process group (init_process_group)")
    monkeypatch.setattr(dist, "init_process_group", group)
    monkeypatch.setattr(c10d, "init_process_group", group)
    try:
        import torch.distributed.device_mesh as device_mesh  # init_device_mesh calls its own imported name
    except ImportError:
        device_mesh = None
    if device_mesh is not None and hasattr(device_mesh, "init_process_group"):
        monkeypatch.setattr(device_mesh, "init_process_group", group)
    yield
    if seen:
        pytest.fail(f"logic-tier test started a {seen[0]}; {_WHERE}", pytrace=False)
