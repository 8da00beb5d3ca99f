"""The SLURM job step this process runs in, and the master address resolved through SLURM.

Only a process started by ``srun`` is a SLURM task (a batch script also sees ``SLURM_PROCID=0``).
The step's first host hosts the rendezvous, at its ``NodeAddr`` (names need not resolve by DNS)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .._log import logger
from ..errors import ConfigError

#: Under SLURM without MASTER_PORT the port comes from the job id: two jobs sharing a node do not collide.
PORT_BASE = 15000
SCONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class SlurmStep:
    """One task of a SLURM job step, as its environment describes it."""

    job_id: int
    procid: int
    """This task's index in the step, 0 .. ntasks-1."""
    localid: int
    """This task's index among the step's tasks on this node."""
    ntasks: int
    nnodes: int
    node_id: int
    """Index of this node in the step's node list."""
    nodelist: str
    tasks_per_node: tuple[int, ...]
    """Tasks of the step on each node, in node-list order."""
    node_name: str
    gpus_on_node: int | None
    """GPUs SLURM allocated on this node (``SLURM_GPUS_ON_NODE``); None when it gave none."""
    restart_count: int
    """How often the job was requeued (``SLURM_RESTART_COUNT``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmStep | None:
        """The step this process is a task of; None outside ``srun`` (batch script, salloc shell, no SLURM)."""
        env = os.environ if env is None else env
        if "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
            return None
        ntasks = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        nnodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
        spread = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        tasks_per_node = tuple(expand_tasks_per_node(spread)) if spread else (max(1, ntasks // max(1, nnodes)),) * nnodes
        gpus = env.get("SLURM_GPUS_ON_NODE")
        return cls(
            job_id=_int(env, "SLURM_JOB_ID", _int(env, "SLURM_JOBID", 0)),
            procid=_int(env, "SLURM_PROCID", 0),
            localid=_int(env, "SLURM_LOCALID", 0),
            ntasks=ntasks,
            nnodes=nnodes,
            node_id=_int(env, "SLURM_NODEID", 0),
            nodelist=nodelist,
            tasks_per_node=tasks_per_node,
            node_name=env.get("SLURMD_NODENAME", ""),
            gpus_on_node=int(gpus) if gpus and gpus.isdigit() else None,
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        )

    @property
    def tasks_on_node(self) -> int:
        if 0 <= self.node_id < len(self.tasks_per_node):
            return self.tasks_per_node[self.node_id]
        return max(1, self.ntasks // max(1, self.nnodes))

    @property
    def default_port(self) -> int:
        return PORT_BASE + self.job_id % 20000

    def check_gpus(self, procs_per_task: int, *, how: str) -> None:
        """Refuse a GPU count on this node that differs from the processes about to run on it."""
        if self.gpus_on_node is None or self.gpus_on_node == 0:
            return
        procs = self.tasks_on_node * procs_per_task
        if procs != self.gpus_on_node:
            where = f"node {self.node_name}" if self.node_name else f"node {self.node_id}"
            raise ConfigError(
                f"SLURM gave {where} {self.gpus_on_node} GPU(s) but {procs} process(es) would run there "
                f"({self.tasks_on_node} task(s) x {procs_per_task} process(es) per task, {how}); "
                f"dtrain runs one process per GPU: match --gpus-per-node to the processes per node."
            )


def env_int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    """``env[key]`` as an int; ``default`` when unset (ConfigError without one, or when malformed)."""
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {key} is not set; start the job with `dtrain run`.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer.") from None


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    """A SLURM variable as an int; an empty one counts as unset."""
    return default if env.get(key) == "" else env_int(env, key, default)


_REPEAT = re.compile(r"^(\d+)\(x(\d+)\)$")


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        m = _REPEAT.match(part)
        if m:
            out += [int(m.group(1))] * int(m.group(2))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ConfigError(f"SLURM tasks-per-node value {spec!r} is not understood (expected e.g. '2(x3),1').")
    return out


_RANGE = re.compile(r"^(\d+)-(\d+)$")


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-03,7],gpu5`` into host names (without scontrol)."""
    hosts: list[str] = []
    parts = re.split(r",(?![^\[]*\])", spec)  # the commas outside brackets
    for part in filter(None, (p.strip() for p in parts)):
        m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            r = _RANGE.match(item)
            if r:
                lo, hi = r.groups()
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    if not hosts:
        raise ConfigError(f"SLURM node list {spec!r} names no host.")
    return hosts


def scontrol(args: list[str], env: Mapping[str, str] | None = None) -> str | None:
    """``scontrol ARGS``'s output, or None when scontrol is missing, fails or takes too long."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                           env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def hostnames(nodelist: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The node list expanded by ``scontrol show hostnames`` (our own parser where that fails)."""
    out = scontrol(["show", "hostnames", nodelist], env)
    hosts = out.split() if out else []
    return hosts or expand_hostlist(nodelist)


def node_address(host: str, env: Mapping[str, str] | None = None) -> str:
    """The address SLURM reaches ``host`` at (its ``NodeAddr``); ``host`` itself if unknown."""
    out = scontrol(["show", "node", host, "--oneliner"], env)
    m = re.search(r"\bNodeAddr=(\S+)", out or "")
    if m and m.group(1) not in ("(null)", ""):
        return m.group(1)
    logger.debug(f"scontrol gave no NodeAddr for {host}; using the host name")
    return host


def master_port(step: SlurmStep, env: Mapping[str, str]) -> int:
    """``MASTER_PORT`` when the job sets it, else the port derived from the job id."""
    return int(env.get("MASTER_PORT") or step.default_port)


def master_address(step: SlurmStep, env: Mapping[str, str]) -> str:
    """``MASTER_ADDR`` when the job sets it, else the address of the step's first node."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if not step.nodelist:
        return "127.0.0.1"
    return node_address(hostnames(step.nodelist, env)[0], env)


def job_state(job_id: int, env: Mapping[str, str] | None = None) -> str | None:
    """The job's state as scontrol reports it (RUNNING, CANCELLED, ...); None when unknown."""
    out = scontrol(["show", "job", str(job_id), "--oneliner"], env)
    m = re.search(r"\bJobState=(\S+)", out or "")
    return m.group(1) if m else None


def requeue(job_id: int, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Ask SLURM to requeue ``job_id`` (``scontrol requeue``); returns (done, scontrol's message)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return False, "scontrol not found"
    try:
        # Its own session: the requeue ends this step's process group, maybe before scontrol reports back.
        r = subprocess.run([exe, "requeue", str(job_id)], capture_output=True, text=True, start_new_session=True,
                           timeout=SCONTROL_TIMEOUT_S, env=dict(env) if env is not None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if r.returncode < 0:  # killed by the job's own end: the requeue went through
        return True, f"scontrol ended by signal {-r.returncode}"
    return r.returncode == 0, (r.stderr or r.stdout).strip()
