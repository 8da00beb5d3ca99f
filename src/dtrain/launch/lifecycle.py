"""The worker's side of a launch: die with the launcher, stop quietly when told to, and hand an
unexpected exception to the launcher instead of losing it.

Every worker ``dtrain run`` / ``dtrain train`` starts runs through :func:`run_worker`, whether or
not its script calls ``dtrain.init()``. The launch link names the launcher's pid (whose death
ends this worker) and a private folder: a ``pid-*`` file per worker (for forwarded signals), a
``stop`` marker once the launcher was told to stop, and ``error-*.json`` files.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..checkpoint.lock import pid_alive
from ..errors import DtrainError
from ..options import launch_link
from ..world.sources import SlurmTasks, TorchrunEnv

STOP_MARKER = "stop"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_stop_signal = 0


def run_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` as a launched worker (see the module's docstring)."""
    bind_to_launcher()
    own_session()
    _install_sigint()
    try:
        result = fn(*args)
    except SystemExit as exc:
        if stop_signal() and exc.code not in (0, None):
            exit_now(128 + stop_signal())
        _settle_backend_threads()
        raise
    except BaseException as exc:  # noqa: BLE001 -- every way out is handled below
        if stop_signal():  # what this raised (a peer's closed socket) follows from the stop: not shown
            exit_now(128 + stop_signal())
        if isinstance(exc, DtrainError):
            _report(exc, user_error=True)
            exit_now(exc.exit_code)
        _report(exc, user_error=False)
        exit_now(1)
    _settle_backend_threads()
    # The work is done: spare the interpreter's exit a full collection of the heap (seconds of CPU).
    gc.disable()
    gc.freeze()
    return result


def _settle_backend_threads() -> None:
    """Let gloo's threads drop the script's last collectives before the interpreter's exit (a plain
    torch script never registers dtrain's exit clean-up)."""
    if "torch.distributed" in sys.modules:
        from ..world.group import settle_backend_threads

        settle_backend_threads()


def stop_signal() -> int:
    """The stop signal this worker received (SIGINT here, SIGTERM/SIGUSR1 via dtrain.context.preempt); 0: none."""
    from ..context import preempt

    return _stop_signal or preempt.received()


def bind_to_launcher() -> None:
    """Make this process die with the launcher, even under ``kill -9`` of the launcher.

    PR_SET_PDEATHSIG fires when the parent *thread* exits (the launcher's main thread starts the
    workers); where the parent is not the launcher or prctl is missing, a thread polls it instead."""
    link = launch_link()
    launcher, launch_dir = link.launcher_pid, link.launch_dir
    if not launcher:
        return
    bound = _set_pdeathsig(signal.SIGKILL)
    if not pid_alive(launcher) or (launch_dir and os.path.exists(os.path.join(launch_dir, STOP_MARKER))):
        exit_now(128 + signal.SIGTERM)  # launcher gone (before prctl) or stopping: do no work
    if not bound or os.getppid() != launcher:
        threading.Thread(target=_watch_launcher, args=(launcher,), name="dtrain-launcher-watch", daemon=True).start()
    if launch_dir:
        with open(os.path.join(launch_dir, f"pid-{os.getpid()}"), "w") as f:
            f.write(TorchrunEnv.rank_label())


def own_session() -> None:
    """Put a launched worker in a session of its own, as torchrun's script workers are: Linux's
    autogroups share the CPU between sessions first, so workers left in the launcher's session
    would share one session's share. Stop signals are forwarded by the launcher (supervise.py)."""
    if not launch_link().launcher_pid or not hasattr(os, "setsid"):
        return
    if SlurmTasks.job_id():
        # Slurm's proctrack/pgid signals and cleans up a step's processes by their process group.
        return
    try:
        if os.getsid(0) != os.getpid():
            os.setsid()
    except OSError:
        pass  # already a process-group leader: keep the session it has


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_launcher(pid: int) -> None:
    while pid_alive(pid):
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _install_sigint() -> None:
    """First SIGINT: remember it and raise KeyboardInterrupt (as Python does); later ones (the
    terminal's and the launcher's copy of the same Ctrl-C) are ignored while unwinding."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        global _stop_signal
        if _stop_signal:
            return
        _stop_signal = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def exit_now(code: int) -> None:
    """Leave now: flush what was printed and skip atexit hooks and C++ destructors, which after
    a failed or interrupted collective only add warnings and can hang."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _report(exc: BaseException, *, user_error: bool) -> None:
    """Hand the error to the launcher (it shows the first rank's, once), or print it without one."""
    rank = TorchrunEnv.rank_label()
    text = f"dtrain: error: {exc}" if user_error else _format(exc)
    launch_dir = launch_link().launch_dir
    if launch_dir and os.path.isdir(launch_dir):
        record = {"rank": rank, "time": time.time(), "user_error": user_error, "type": type(exc).__name__, "text": text}
        tmp = os.path.join(launch_dir, f".error-{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(launch_dir, f"error-{os.getpid()}.json"))
        return
    print(text if user_error else f"dtrain: worker rank {rank} raised:\n{text}", file=sys.stderr, flush=True)


def _format(exc: BaseException) -> str:
    """The traceback without the frames of the launch machinery above the user's code."""
    tb = exc.__traceback__
    ours = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(__import__("runpy").__file__)))
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename.startswith("<frozen runpy") or os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(ours)):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def read_errors(launch_dir: str) -> list[dict[str, Any]]:
    """The workers' error records, the earliest first."""
    out = []
    for name in os.listdir(launch_dir):
        if name.startswith("error-") and name.endswith(".json"):
            try:
                with open(os.path.join(launch_dir, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(out, key=lambda r: r.get("time", 0.0))
