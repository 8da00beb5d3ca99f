"""One writer per checkpoint folder: ``dtrain.lock`` names the job that writes there. The run id
names the job, not the process, so elastic restarts and SLURM requeues take their own lock back;
a holder dead on this host is taken over with a warning."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from .._log import logger
from ..errors import CheckpointError
from ..options import launch_link
from ..world.sources import SlurmTasks, TorchrunEnv

LOCK_FILE = "dtrain.lock"
_held: dict[str, int] = {}  # real path of a lock file this process holds -> how many managers use it


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    started: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {when})"


def this_holder() -> Holder:
    host, pid = socket.gethostname(), os.getpid()
    return Holder(host=host, pid=pid, run_id=run_id(host, pid), started=time.time())


def run_id(host: str, pid: int) -> str:
    """The job this process belongs to, by the launchers' own ids (the launching process checks
    the lock before any World exists); each survives its launcher's restarts."""
    slurm_job, elastic, agent_run = SlurmTasks.job_id(), launch_link().elastic, TorchrunEnv.run_id()
    if slurm_job:
        return f"slurm-{slurm_job}"
    if elastic:  # --nnodes MIN:MAX: rank 0 may move to another node's agent
        return f"elastic-{elastic}"
    if agent_run:
        return f"elastic-{agent_run}@{host}:{os.getppid()}"
    return f"pid-{pid}@{host}"


def _read(path: str) -> Holder | None:
    """The holder a lock file names; None when it names nobody readable (an empty or torn file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        return Holder(host=str(raw["host"]), pid=int(raw["pid"]), run_id=str(raw["run_id"]), started=float(raw["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder_of(folder: str) -> Holder | None:
    """Who holds ``folder`` now (a live process, or one on another host); None when nobody."""
    holder = _read(os.path.join(folder, LOCK_FILE))
    return None if holder is None or _stale(holder, this_holder()) else holder


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 probes without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def _stale(holder: Holder | None, me: Holder) -> bool:
    return holder is None or (holder.host == me.host and not pid_alive(holder.pid))


def _refusal(folder: str, path: str, holder: Holder) -> CheckpointError:
    return CheckpointError(
        f"checkpoint folder {folder} is in use by {holder.describe()}; give this job another --checkpoint-dir, "
        f"or stop that job first (if it is gone, remove {path})."
    )


def _check_folder(folder: str) -> None:
    """A folder that is a file, or cannot be created or written, fails here, before training."""
    from .._check import make_dir

    make_dir("checkpoint folder", folder, "--checkpoint-dir", CheckpointError)


def preflight(folder: str, *, check_holder: bool = True) -> None:
    """Before any worker starts (in the launching process): the folder is usable and (with
    ``check_holder``) no live job of another run holds it. Creates nothing but the folder."""
    _check_folder(folder)
    if not check_holder:
        return
    path = os.path.join(folder, LOCK_FILE)
    holder, me = _read(path), this_holder()
    if os.path.exists(path) and holder is not None and not _stale(holder, me) and holder.run_id != me.run_id:
        raise _refusal(folder, path, holder)


def acquire(folder: str) -> str:
    """Take the lock of ``folder`` for this process's run; returns the lock file's path.
    CheckpointError (one line naming the holder) when another live run holds it."""
    _check_folder(folder)
    path = os.path.join(folder, LOCK_FILE)
    key = os.path.realpath(path)
    if key in _held:
        _held[key] += 1
        return path
    me = this_holder()
    record = json.dumps(asdict(me))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        _take_over(folder, path, me, record)
    except OSError as exc:
        raise CheckpointError(f"cannot create {path}: {exc.strerror or exc}; choose a writable --checkpoint-dir.") from None
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(record)
    _held[key] = 1
    return path


def _take_over(folder: str, path: str, me: Holder, record: str) -> None:
    holder = _read(path)
    for _ in range(20):  # created this instant by another job that has not written its record yet
        if holder is not None or time.time() - _mtime(path) > 2:
            break
        time.sleep(0.1)
        holder = _read(path)
    if holder is not None and holder.run_id == me.run_id:
        logger.debug(f"{path}: taken over from an earlier process of the same run ({holder.describe()})")
    elif _stale(holder, me):
        what = holder.describe() if holder else "an unreadable holder"
        logger.warning(f"{path} was held by {what}, which is no longer running; taking it over.")
    else:
        raise _refusal(folder, path, holder)
    tmp = f"{path}.{me.pid}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(record)
    os.replace(tmp, path)
    now = _read(path)  # two jobs taking over at once: the last rename wins, the other one stops
    if now is None or (now.pid, now.host) != (me.pid, me.host):
        raise _refusal(folder, path, now or holder)


def release(path: str) -> None:
    """Give the lock back (the last of this process's users); only if this process holds it."""
    key = os.path.realpath(path)
    if key not in _held:
        return
    _held[key] -= 1
    if _held[key] > 0:
        return
    del _held[key]
    holder = _read(path)
    if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
        with contextlib.suppress(OSError):
            os.unlink(path)


@atexit.register
def _release_all() -> None:
    """A script that never closes its context still frees its folders at exit."""
    for key in list(_held):
        _held[key] = 1
        release(key)

