"""Start a fault-tolerant job on this node: the Lighthouse (on the first node, unless
``--lighthouse`` names one), then one process per replica group, each restarted up to
``--max-restarts`` times when it dies (it heals from a live peer when it is back).

Replica groups: one process each for now (``--nproc N``: N replica groups on this node). Their
ids are stable across restarts (``{node}`` or ``{node}-{i}``, or ``--replica-id``'s), so a
restarted group finds its checkpoint folder and its ledger name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import torch

from .._log import logger
from ..errors import ConfigError
from ..train.config import TrainConfig
from ..world.netif import is_loopback, source_address, use_route_interface
from .replica import replica_main
from .spec import DEFAULT_LIGHTHOUSE_PORT, FaultTolerance, lighthouse_address, require_torchft

RESTART_DELAY_S = 1.0
"""Between a replica group's death and its restart (its peers notice it gone meanwhile)."""


def start(cfg: TrainConfig, ft: FaultTolerance, *, nproc: int, nnodes: int, node_rank: int, master_addr: str | None,
          lighthouse: str | None, replica_id: str | None, max_restarts: int) -> int:
    """Run this node's part of the job; returns the exit status (0: a replica group finished)."""
    if cfg.parallel.layout or cfg.parallel.strategy not in ("auto", "single", "ddp"):
        raise ConfigError(f"--fault-tolerance replicates the model across replica groups of one process each, got "
                          f"--strategy {cfg.parallel.strategy}{' --parallel ' + cfg.parallel.layout if cfg.parallel.layout else ''}; "
                          "drop it (sharding inside a replica group is not supported yet).")
    if cfg.batch.grad_accum != 1 or cfg.batch.global_batch:
        raise ConfigError("--fault-tolerance keeps each replica group's --batch-size (the global batch follows the quorum); "
                          "--grad-accum and --elastic-batch global are not supported with it yet.")
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
    lh_host = lighthouse.removeprefix("http://").rpartition(":")[0].strip("[]")
    host = "127.0.0.1" if is_loopback(lh_host) else (source_address(lh_host) or lh_host)
    use_route_interface(lh_host, backend="gloo")  # gloo's sockets on the interface peers reach
    base = replica_id if replica_id is not None else str(node_rank)
    ids = [base] if nproc == 1 else [f"{base}-{i}" for i in range(nproc)]
    try:
        if server is None and nproc == 1:  # a replica group started by hand or by its scheduler: this process
            replica_main(cfg, ft, ids[0], lighthouse, host)
            return 0
        return _supervise(cfg, ft, ids, lighthouse, host, max_restarts)
    finally:
        if server is not None:
            server.shutdown()


def _lighthouse(ft: FaultTolerance, *, port: int) -> Any:
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(bind=f"[::]:{port}", min_replicas=ft.min_replicas, join_timeout_ms=int(ft.join_s * 1000),
                                quorum_tick_ms=100, heartbeat_timeout_ms=int(ft.heartbeat_s * 1000))
    except Exception as exc:  # the port is taken, most likely
        raise ConfigError(f"cannot start the Lighthouse on port {port} ({str(exc).splitlines()[0][:120]}); "
                          "free the port, or give a running one with --lighthouse HOST:PORT.") from None


def _supervise(cfg: TrainConfig, ft: FaultTolerance, ids: list[str], lighthouse: str, host: str, max_restarts: int) -> int:
    """Start one process per replica group; restart one that dies (up to ``max_restarts`` times in all)."""
    spawn = mp.get_context("spawn")
    # torchrun's rule (and dtrain's launcher's): one intra-op thread per process when several share
    # the node, unless the user chose; N groups x all cores each made a step 20x slower here.
    threads = None if len(ids) == 1 or "OMP_NUM_THREADS" in os.environ else 1

    def launch(rid: str) -> Any:
        proc = spawn.Process(target=_replica_process, args=(threads, cfg, ft, rid, lighthouse, host), name=f"dtrain-replica-{rid}")
        proc.start()
        return proc

    procs = {rid: launch(rid) for rid in ids}
    finished: dict[str, int] = {}
    restarts = 0
    try:
        while procs:
            time.sleep(0.2)
            for rid, proc in list(procs.items()):
                if proc.exitcode is None:
                    continue
                del procs[rid]
                code = proc.exitcode
                # Once a group has finished the job, one that dies is not started again (it would train alone).
                if code == 0 or restarts >= max_restarts or 0 in finished.values():
                    finished[rid] = code
                    if code != 0:
                        logger.warning(f"fault tolerance: replica group {rid} ended with {_status(code)}; not restarted "
                                       f"({restarts} of --max-restarts {max_restarts} used)")
                    continue
                restarts += 1
                logger.warning(f"fault tolerance: replica group {rid} ended with {_status(code)}; restart {restarts} of "
                               f"{max_restarts} in {RESTART_DELAY_S:g} s (it heals from a live peer)")
                time.sleep(RESTART_DELAY_S)
                procs[rid] = launch(rid)
    finally:
        for proc in procs.values():  # interrupted: no replica group outlives its launcher
            proc.terminate()
            proc.join(5)
    codes = list(finished.values())
    return 0 if 0 in codes else next((c for c in codes if c > 0), 1)


def _replica_process(threads: int | None, *args: Any) -> None:
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for what this process starts
        torch.set_num_threads(threads)
    replica_main(*args)


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
