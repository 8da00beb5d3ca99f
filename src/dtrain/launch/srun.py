"""``dtrain run`` as a task of ``srun``: the "one task per node" layout.

    srun -N 2 --ntasks-per-node 1 dtrain run -n 4 train.py    # 2 agents x 4 workers = 8 ranks

Each SLURM task is one node's agent: node rank = the task's index, so the world size is tasks x
processes per task. The master is the step's first node (``dtrain.world.slurm``); the port comes
from the job id unless ``MASTER_PORT`` or ``--master-port`` says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError
from ..world.slurm import SlurmStep, master_address
from ..world.slurm import master_port as env_master_port
from .spec import LaunchSpec


def spec_for_step(step: SlurmStep, env: Mapping[str, str] | None = None, *, nproc: int, master_port: int | None = None,
                  launcher: str = "torchrun", max_restarts: int = 0) -> LaunchSpec:
    """The launch of this task's share of the job: ``nproc`` workers, node rank = task index (``env``:
    where the master's address and port are read, default ``os.environ``)."""
    env = os.environ if env is None else env
    if step.tasks_on_node > 1 and step.ntasks > 1:
        raise ConfigError(
            f"srun started {step.tasks_on_node} tasks on this node and each would start -n {nproc} process(es); "
            f"use one task per node (srun --ntasks-per-node=1 ... -n {nproc * step.tasks_on_node}) "
            f"or one task per process (srun --ntasks-per-node={nproc * step.tasks_on_node} ..., without -n)."
        )
    step.check_gpus(nproc, how=f"dtrain run -n {nproc} in each task")
    if step.ntasks == 1:
        return LaunchSpec(nproc=nproc, master_port=master_port, launcher=launcher, max_restarts=max_restarts)
    port = master_port if master_port is not None else env_master_port(step, env)
    return LaunchSpec(
        nproc=nproc, nnodes=step.ntasks, node_rank=step.procid, master_addr=master_address(step, env),
        master_port=port, launcher=launcher, max_restarts=max_restarts,
    )
