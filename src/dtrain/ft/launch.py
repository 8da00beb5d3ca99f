"""Start a fault-tolerant job on this node: the Lighthouse (on the first node, unless
``--lighthouse`` names one), then the replica groups, each restarted up to ``--max-restarts``
times when it dies (it heals from a live peer when it is back).

Replica groups: one process each (``--nproc N``: N replica groups on this node), or one group of
the node's N processes (``Groups.size``: ``--strategy fsdp`` shards the model over them). Their
ids are stable across restarts (``{node}`` or ``{node}-{i}``, or ``--replica-id``'s), so a
restarted group finds its checkpoint folder and its ledger name. What a group's process runs is
the caller's (``Groups``): ``dtrain train``'s loop, or a user's script (``ScriptGroups``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Protocol

from .._log import logger
from ..errors import ConfigError
from ..options import FaultToleranceLink
from ..world.netif import is_loopback, source_address, use_route_interface
from .spec import DEFAULT_LIGHTHOUSE_PORT, LEFT_EXIT, FaultTolerance, lighthouse_address, require_torchft

RESTART_DELAY_S = 1.0
"""Between a replica group's death and its restart (its peers notice it gone meanwhile)."""

MISTAKE_EXIT = ConfigError.exit_code
"""A group that ends with it printed a user's mistake (``replica_main``: a ``DtrainError``'s line)."""


class Groups(Protocol):
    """What one replica group's processes run."""

    size: int
    """Processes per replica group."""

    def spawn(self, replica_id: str, lighthouse: str, host: str, threads: int | None) -> Any:
        """Start a group's process: an object with ``exitcode``, ``terminate()`` and ``join(timeout)``."""

    def run_here(self, replica_id: str, lighthouse: str, host: str) -> int:
        """Run the group in this process (a group started by hand or by its scheduler); its exit status."""


def start(ft: FaultTolerance, groups: Groups, *, nproc: int, nnodes: int, node_rank: int, master_addr: str | None,
          lighthouse: str | None, replica_id: str | None, max_restarts: int) -> int:
    """Run this node's part of the job; returns the exit status (0: a replica group finished)."""
    given = lighthouse_address(lighthouse) if lighthouse is not None else None
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft loads: else its servers log every quorum
    require_torchft()
    server = None
    if given is not None:
        lighthouse = given
    elif lighthouse is None:
        if node_rank == 0:
            server = _lighthouse(ft, port=0 if nnodes == 1 else DEFAULT_LIGHTHOUSE_PORT)
            port = server.address().rpartition(":")[2]
            lighthouse = f"http://{master_addr or '127.0.0.1'}:{port}"
            logger.info(f"fault tolerance: Lighthouse at {lighthouse} (min {ft.min_replicas} replica group(s)); "
                        f"other nodes: --lighthouse {lighthouse.removeprefix('http://')}")
        else:
            lighthouse = f"http://{master_addr}:{DEFAULT_LIGHTHOUSE_PORT}"
    host = reach(lighthouse)
    base = replica_id if replica_id is not None else str(node_rank)
    count = max(1, nproc // groups.size)
    ids = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    try:
        if server is None and nproc == 1:  # a replica group started by hand or by its scheduler: this process
            return groups.run_here(ids[0], lighthouse, host)
        # torchrun's rule (and dtrain's launcher's): one intra-op thread per process when several share
        # the node, unless the user chose; N groups x all cores each made a step 20x slower here.
        threads = None if nproc == 1 or "OMP_NUM_THREADS" in os.environ else 1
        return _supervise(groups, ids, lighthouse, host, max_restarts, threads)
    finally:
        if server is not None:
            server.shutdown()


def reach(lighthouse: str) -> str:
    """The address the Lighthouse's peers reach this process at; gloo's sockets on that interface."""
    lh_host = lighthouse.removeprefix("http://").rpartition(":")[0].strip("[]")
    use_route_interface(lh_host, backend="gloo")  # this process's children inherit it
    return "127.0.0.1" if is_loopback(lh_host) else (source_address(lh_host) or lh_host)


def _lighthouse(ft: FaultTolerance, *, port: int) -> Any:
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(bind=f"[::]:{port}", min_replicas=ft.min_replicas, join_timeout_ms=int(ft.join_s * 1000),
                                quorum_tick_ms=100, heartbeat_timeout_ms=int(ft.heartbeat_s * 1000))
    except Exception as exc:  # the port is taken, most likely
        raise ConfigError(f"cannot start the Lighthouse on port {port} ({str(exc).splitlines()[0][:120]}); "
                          "free the port, or give a running one with --lighthouse HOST:PORT.") from None


def _supervise(groups: Groups, ids: list[str], lighthouse: str, host: str, max_restarts: int, threads: int | None) -> int:
    """Start each replica group's processes; restart a group that dies (up to ``max_restarts`` times in all)."""
    def launch(rid: str) -> Any:
        return groups.spawn(rid, lighthouse, host, threads)

    procs = {rid: launch(rid) for rid in ids}
    finished: dict[str, int] = {}
    restarts, stopping = 0, []

    def stop(signum: int, frame: object) -> None:  # each group leaves at its next step boundary, saving first
        stopping.append(signum)
        for proc in procs.values():
            proc.terminate()

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        while procs:
            time.sleep(0.2)
            for rid, proc in list(procs.items()):
                code = proc.exitcode  # read once: a lost group's status is its first failure, not its rest's kill
                if code is None:
                    continue
                del procs[rid]
                # Once a group has finished the job, one that dies is not started again (it would train alone);
                # nor one that left on a stop signal, nor one that refused a mistake (exit status 2, its one line
                # printed: a restart meets it again, and a line here would be a second one).
                if code in (0, LEFT_EXIT, MISTAKE_EXIT) or stopping or restarts >= max_restarts or 0 in finished.values():
                    finished[rid] = code
                    if code == LEFT_EXIT:
                        logger.info(f"fault tolerance: replica group {rid} left the job on a stop signal; not restarted")
                    elif code == MISTAKE_EXIT:
                        logger.debug(f"fault tolerance: replica group {rid} ended with exit status 2 (its line said why)")
                    elif code != 0:
                        logger.warning(f"fault tolerance: replica group {rid} ended with {_status(code)}; not restarted "
                                       f"({restarts} of --max-restarts {max_restarts} used)")
                    continue
                restarts += 1
                logger.warning(f"fault tolerance: replica group {rid} ended with {_status(code)}; restart {restarts} of "
                               f"{max_restarts} in {RESTART_DELAY_S:g} s (it heals from a live peer)")
                time.sleep(RESTART_DELAY_S)
                procs[rid] = launch(rid)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for proc in procs.values():  # interrupted: no replica group outlives its launcher
            proc.terminate()
            proc.join(5)
    codes = list(finished.values())
    return 0 if 0 in codes else next((c for c in codes if c > 0), 1)


class ScriptGroups:
    """Replica groups that run a user's script (``dtrain run --fault-tolerance``): each learns its
    part from ``DTRAIN_FT*`` (``dtrain.init`` reads them; ``FaultToleranceLink``)."""

    size = 1

    def __init__(self, ft: FaultTolerance, script: str, args: list[str]) -> None:
        self.ft, self.command = ft, [sys.executable, script, *args]
        self._started: set[str] = set()
        """The ids started before: a second start of one is its launcher's restart."""

    def _env(self, replica_id: str, lighthouse: str, threads: int | None) -> dict[str, str]:
        restart = replica_id in self._started
        self._started.add(replica_id)
        link = FaultToleranceLink(spec=self.ft.to_text(), lighthouse=lighthouse, replica_id=replica_id, restart=restart)
        return {**os.environ, **link.to_env(), **({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})}

    def spawn(self, replica_id: str, lighthouse: str, host: str, threads: int | None) -> Any:
        return _Child(subprocess.Popen(self.command, env=self._env(replica_id, lighthouse, threads)))

    def run_here(self, replica_id: str, lighthouse: str, host: str) -> int:
        child = self.spawn(replica_id, lighthouse, host, None)
        try:
            return child.wait()
        finally:
            child.terminate()


class _Child:
    """A script's process as ``_supervise`` watches one (multiprocessing's shape)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        return self.proc.wait()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
