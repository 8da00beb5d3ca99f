"""Who started this process, read from its launcher's environment: one small class per source,
tried in ``SOURCES``'s order; the first that recognises the environment gives the ``World``
fields. No module outside ``dtrain.world`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` or ``SLURM_*``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .slurm import SlurmStep, env_int, master_address

Fields = dict[str, Any]
"""Some of ``World``'s fields, by name."""


class TorchrunEnv:
    """torchrun, ``dtrain run`` (both launchers) and torch's elastic agent."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> Fields | None:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        size = env_int(env, "WORLD_SIZE")
        local_size = env_int(env, "LOCAL_WORLD_SIZE", size)
        return {
            "rank": env_int(env, "RANK"),
            "local_rank": env_int(env, "LOCAL_RANK", 0),
            "size": size,
            "local_size": local_size,
            "node_rank": env_int(env, "GROUP_RANK", env_int(env, "RANK") // max(1, local_size)),
            "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": env_int(env, "MASTER_PORT", 0),
            "source": "torchrun",
            "restart_count": env_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        }

    @staticmethod
    def rank_label(env: Mapping[str, str] | None = None) -> str:
        """``RANK`` as the launcher gave it, '?' without one: a label that never fails."""
        return _env(env).get("RANK", "?")

    @staticmethod
    def local_rank(env: Mapping[str, str] | None = None) -> str | None:
        """``LOCAL_RANK`` as given (None: not started by such a launcher)."""
        return _env(env).get("LOCAL_RANK")

    @staticmethod
    def size(env: Mapping[str, str] | None = None) -> int:
        """``WORLD_SIZE`` (1 without one), for the drop-in guard that runs before the script's own start."""
        return int(_env(env).get("WORLD_SIZE", "1"))

    @staticmethod
    def run_id(env: Mapping[str, str] | None = None) -> str | None:
        """The elastic agent's run id (``TORCHELASTIC_RUN_ID``); None outside the agent."""
        return _env(env).get("TORCHELASTIC_RUN_ID") or None

    @staticmethod
    def restarts_left(env: Mapping[str, str] | None = None) -> int:
        """The agent's restarts not used yet (``TORCHELASTIC_MAX_RESTARTS`` - ``TORCHELASTIC_RESTART_COUNT``)."""
        env = _env(env)
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))


class SlurmTasks:
    """One SLURM task per process (a step of one task, ``srun dtrain run``, is a launcher, not this source)."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> Fields | None:
        step = SlurmStep.from_env(env)
        if step is None or step.ntasks <= 1:
            return None
        step.check_gpus(1, how="one task per process")
        return {
            "rank": step.procid,
            "local_rank": step.localid,
            "size": step.ntasks,
            "local_size": step.tasks_on_node,
            "node_rank": step.node_id,
            "master_addr": master_address(step, env),
            "master_port": env_int(env, "MASTER_PORT", step.default_port),
            "source": "slurm",
        }

    @staticmethod
    def job(env: Mapping[str, str]) -> Fields:
        """The SLURM job this process belongs to, whichever source started it (``srun dtrain run`` too)."""
        if not env.get("SLURM_JOB_ID"):
            return {}
        return {"slurm_job_id": env_int(env, "SLURM_JOB_ID"), "requeue_count": env_int(env, "SLURM_RESTART_COUNT", 0)}

    @staticmethod
    def job_id(env: Mapping[str, str] | None = None) -> str | None:
        """``SLURM_JOB_ID`` as given (None: not inside a SLURM job), without parsing it."""
        return _env(env).get("SLURM_JOB_ID") or None


class OneProcess:
    """No launcher: one process, rank 0 of 1."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> Fields:
        return {"source": "single"}


SOURCES = (TorchrunEnv, SlurmTasks, OneProcess)
"""Tried in this order: torchrun's variables win over SLURM's (``srun dtrain run`` has both)."""


def detect(env: Mapping[str, str]) -> Fields:
    """The World fields ``env`` gives, device aside: the first source's that answers, and the SLURM job's."""
    for source in SOURCES:
        fields = source.detect(env)
        if fields is not None:
            return {**fields, **SlurmTasks.job(env)}
    raise AssertionError("OneProcess answers every environment")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env
