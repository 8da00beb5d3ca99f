"""SLURM as dtrain sees it from a task's environment, and preemption (no cluster needed)."""

from __future__ import annotations

import os
import signal

import dtrain
from dtrain import preempt
from tests.logic.world import test_slurm_env as logic_half
from tests.support import run_distributed

# The logic half's fixtures, shared: pytest finds a fixture by its name in the module.
no_scontrol = logic_half.no_scontrol


def _one_rank_signalled() -> tuple[bool, list[str]]:
    ctx = dtrain.init("ddp")
    ran: list[str] = []
    preempt.install()
    preempt.register(lambda: ran.append(f"rank{ctx.rank}"))
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    stopped = preempt.check(ctx)
    preempt.uninstall()
    ctx.close()
    return stopped, ran


def test_a_signal_on_one_rank_stops_every_rank():
    assert run_distributed(_one_rank_signalled, world_size=2, timeout=90) == [(True, ["rank0"]), (True, ["rank1"])]
