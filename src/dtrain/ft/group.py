"""A replica group of several processes (``--fault-tolerance`` with ``--strategy fsdp`` or a
``--parallel`` layout): local rank i of every group is one torchft participant, averaging its
shard with the other groups' rank i. Each start of a group gets a fresh store (a restart never
reads what the dead processes left); a group is whole or lost: one process that fails takes the
others down (they would only wait in a collective), and the launcher restarts the group as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .spec import LEFT_EXIT


@dataclass(frozen=True)
class GroupLink:
    """One process's place in its replica group, and where the group's store is."""

    rank: int
    size: int
    host: str
    port: int

    def env(self) -> dict[str, str]:
        """The variables a torchrun worker gets (``dtrain.world`` reads them): the group is this process's world."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.rank), "WORLD_SIZE": str(self.size),
                "LOCAL_WORLD_SIZE": str(self.size), "GROUP_RANK": "0", "MASTER_ADDR": self.host,
                "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


class GroupProcs:
    """The processes of one replica group, watched as one (``exitcode``, ``terminate``, ``join``)."""

    def __init__(self, start: Callable[[GroupLink], Any], size: int, host: str) -> None:
        from torch.distributed import TCPStore

        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.procs = [start(GroupLink(rank, size, host, self._store.port)) for rank in range(size)]

    @property
    def exitcode(self) -> int | None:
        """None while the group runs; a process's failure (the others are killed then); else 0,
        or ``LEFT_EXIT`` when the group left on a stop signal."""
        codes = [p.exitcode for p in self.procs]
        failed = [c for c in codes if c not in (None, 0, LEFT_EXIT)]
        if failed:
            for proc in self.procs:
                if proc.exitcode is None:
                    proc.kill()  # the rest of a lost group: stuck in a collective until its timeout otherwise
            for proc in self.procs:
                proc.join(5)
            return failed[0]
        if None in codes:
            return None
        return LEFT_EXIT if LEFT_EXIT in codes else 0

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()

    def join(self, timeout: float | None = None) -> None:
        for proc in self.procs:
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
