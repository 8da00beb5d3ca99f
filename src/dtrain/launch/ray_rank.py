"""One rank of a job on a Ray cluster: the actor Ray places, and the worker process it starts as
``dtrain run``'s launcher would. The worker is a process of its own, not code inside the actor: it
exits through ``os._exit``, starts its own session and handles SIGTERM, none of which a Ray worker
may do. This module imports without Ray: the driver wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

from ..options import LAUNCH_DIR_ENV
from .lifecycle import read_errors, run_worker
from .supervise import _DIR_PREFIX, _remove_stale_dirs

#: The worker command for a function: ``python -m dtrain.launch.ray_rank FILE`` (FILE: the pickled call).
FUNCTION_ENTRY = "dtrain.launch.ray_rank"


class RankActor:
    """Ray's handle on one rank: where it landed, the rendezvous store (rank 0's actor), and its
    worker process, whose output it keeps until the driver asks (``poll``)."""

    def __init__(self) -> None:
        _remove_stale_dirs()  # the folders of actors killed before (Ray kills an actor with SIGKILL)
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")  # as supervise.py names them
        self.proc: subprocess.Popen | None = None
        self.store: Any = None
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._lock = threading.Lock()
        self._drains: list[threading.Thread] = []

    def place(self) -> dict[str, Any]:
        """The node this actor runs on, and the GPUs Ray gave it."""
        import ray

        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def host_store(self, addr: str) -> int:
        """Rank 0's actor hosts the rendezvous store on its node's address; returns the port (a free one)."""
        from .store import host_store

        self.store, port = host_store(addr, 0)
        return port

    def start(self, command: list[str], env: dict[str, str], cwd: str | None, call: bytes | None) -> int:
        """Start ``python COMMAND...`` as the worker, with this node's interpreter (``call``: the
        pickled function and arguments of a function worker); returns its pid."""
        command = [sys.executable, *command]
        if call is not None:
            path = os.path.join(self.dir, "call.pkl")
            with open(path, "wb") as f:
                f.write(call)
            command = [*command, path]
        full = {**os.environ, **env, "DTRAIN_LAUNCHER_PID": str(os.getpid()), LAUNCH_DIR_ENV: self.dir}
        if cwd is not None and not os.path.isdir(cwd):
            cwd = None  # another node without the driver's folder: the actor's own (the error, if any, is the worker's)
        # From the actor's main thread: the worker's PR_SET_PDEATHSIG fires when the actor ends.
        self.proc = subprocess.Popen(command, env=full, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._drains = [threading.Thread(target=self._drain, args=(stream, sink), daemon=True)
                        for stream, sink in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for t in self._drains:
            t.start()
        return self.proc.pid

    def _drain(self, stream: Any, sink: list[bytes]) -> None:
        for line in iter(stream.readline, b""):
            with self._lock:
                sink.append(line)

    def poll(self, wait_s: float) -> dict[str, Any]:
        """Wait up to ``wait_s`` for the worker; its exit status (None: running), the output since the
        last call and, once it exited, the error it reported."""
        assert self.proc is not None, "start() first"
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:  # the drain threads end with the pipes; take the last lines too
            for t in self._drains:
                t.join(1.0)
        with self._lock:
            out, err = b"".join(self._out), b"".join(self._err)
            self._out.clear()
            self._err.clear()
        return {"code": code, "out": out, "err": err, "errors": read_errors(self.dir) if code is not None else []}

    def signal(self, signum: int) -> None:
        """Forward a stop signal (the driver's SIGTERM: ``dtrain train`` saves and stops)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.store = None
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    """``python -m dtrain.launch.ray_rank FILE``: run the pickled ``(fn, args)`` as a launched worker."""
    with open(sys.argv[1], "rb") as f:
        fn, args = pickle.load(f)
    run_worker(fn, *args)


if __name__ == "__main__":
    main()
