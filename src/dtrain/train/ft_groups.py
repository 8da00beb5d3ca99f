"""How ``dtrain train --fault-tolerance`` starts its replica groups (``dtrain.ft.launch.Groups``):
each group's processes, and a process's entry point (its result line, or one line and an exit status)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from typing import Any

import torch

from .._log import configure_cli_logging
from ..errors import DtrainError
from ..ft.group import GroupLink, GroupProcs
from ..ft.session import quiet_torchft
from ..ft.spec import LEFT_EXIT, FaultTolerance
from .config import TrainConfig
from .ft_replica import run_replica


class TrainGroups:
    """Replica groups that run ``dtrain train``'s loop (``dtrain.ft.launch.Groups``); ``size``
    processes each (``--strategy fsdp``: the node's ``--nproc``, the model sharded over them)."""

    def __init__(self, cfg: TrainConfig, ft: FaultTolerance, size: int = 1) -> None:
        self.cfg, self.ft, self.size = cfg, ft, size
        self._started: set[str] = set()
        """The ids started before: a second start of one is its launcher's restart."""

    def spawn(self, replica_id: str, lighthouse: str, host: str, threads: int | None) -> Any:
        restart = replica_id in self._started
        self._started.add(replica_id)

        def start(link: GroupLink | None) -> Any:
            name = f"dtrain-replica-{replica_id}" + (f"-rank{link.rank}" if link is not None else "")
            proc = mp.get_context("spawn").Process(target=_replica_process, name=name,
                                                   args=(threads, link, restart, self.cfg, self.ft, replica_id, lighthouse, host))
            proc.start()
            return proc

        return GroupProcs(start, self.size, host) if self.size > 1 else start(None)

    def run_here(self, replica_id: str, lighthouse: str, host: str) -> int:
        replica_main(self.cfg, self.ft, replica_id, lighthouse, host)
        return 0


def _replica_process(threads: int | None, link: GroupLink | None, restart: bool, *args: Any) -> None:
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for what this process starts
        torch.set_num_threads(threads)
    if link is not None:
        os.environ.update(link.env())  # this process's world: its replica group (read by World.detect)
    replica_main(*args, in_group=link is not None, restart=restart)


def replica_main(cfg: TrainConfig, ft: FaultTolerance, replica_id: str, lighthouse: str, host: str, *, in_group: bool = False,
                 restart: bool = False) -> None:
    """Entry point of one replica group's process: train, print its result line (the group's rank 0),
    or one line and exit status."""
    quiet_torchft()
    configure_cli_logging(0)
    try:
        result = run_replica(cfg, ft, replica_id=replica_id, lighthouse=lighthouse, host=host, in_group=in_group,
                             restart=restart)
    except DtrainError as exc:
        print(f"dtrain: error: replica group {replica_id}: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    if result.get("ended"):
        return  # came back after the job's end: its line said so; the others printed the job's result
    if result["rank"] == 0:
        # one write, newline included: the groups share the launcher's stdout, and print's two writes interleave
        sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "rank"}) + "\n")
        sys.stdout.flush()
    if result["left"]:
        sys.exit(LEFT_EXIT)  # not a failure, and not the job's end: its launcher does not restart it
