"""A job description as an sbatch script, and its submission (docs/clusters.md).

The script asks for ``--requeue`` and ``--signal=USR1@<signal_before_s>``, so ``dtrain train``
checkpoints and requeues before the time limit. An elastic job (``nodes = "MIN:MAX"``) asks for
``--nodes=MIN-MAX`` and ``--no-kill``, its rendezvous on the allocation's first node.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from ..errors import ConfigError, LaunchError
from ..world.slurm import PORT_BASE
from .jobspec import JobSpec, mem_mib
from .jobvalues import comment, one_line, sbatch_arg

ELASTIC_NOTE = ("SLURM starts an elastic job on MIN to MAX nodes and, with --no-kill, goes on when nodes fail (down to "
                "MIN), but cannot add nodes to a running job: no node joins it later")


def job_env(job: JobSpec) -> dict[str, str]:
    """The job's environment, with one OpenMP thread per CPU of a process unless it says otherwise
    (every process would take every core it sees, oversubscribing the node)."""
    return {"OMP_NUM_THREADS": str(job.cpus_per_proc), **job.env}


def tasks_per_node(job: JobSpec) -> int:
    return 1 if job.layout == "node" else job.procs_per_node


def cpus_per_task(job: JobSpec) -> int:
    return job.cpus_per_proc * (job.procs_per_node if job.layout == "node" else 1)


def srun_argv(job: JobSpec) -> list[str]:
    """The srun line of the script: one step with every task of the job."""
    t, cpus = tasks_per_node(job), cpus_per_task(job)
    launch = ["-n", str(job.procs_per_node)] if job.layout == "node" else []
    if job.elastic:  # the nodes SLURM gave (MIN..MAX); "$..." is expanded by the script's shell
        launch += ["--nnodes", job.nodes_text(), "--master-addr", _SH_MASTER, "--master-port", _SH_PORT, "--rdzv-id", _SH_JOB]
        return ["srun", f"--nodes={_SH_NODES}", f"--ntasks={_SH_NODES}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
                "--no-kill", "--kill-on-bad-exit=0", *job.task_argv(launch)]
    return [
        "srun", f"--nodes={job.nodes}", f"--ntasks={job.nodes * t}", f"--ntasks-per-node={t}",
        f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1", *job.task_argv(launch),
    ]


#: Placeholders of an elastic srun line, written unquoted as shell expansions (``_shell_line``).
_SH_NODES, _SH_MASTER, _SH_PORT, _SH_JOB = "@NODES@", "@MASTER@", "@PORT@", "@JOB@"
_SH = {_SH_NODES: '"$SLURM_JOB_NUM_NODES"', _SH_MASTER: '"$DTRAIN_MASTER"', _SH_PORT: f'"$(({PORT_BASE} + SLURM_JOB_ID % 20000))"',
       _SH_JOB: '"slurm-$SLURM_JOB_ID"'}


def _shell_line(argv: list[str]) -> str:
    line = shlex.join(argv)
    for key, value in _SH.items():
        line = line.replace(key, value)
    return line


def render(job: JobSpec, *, source: str = "") -> str:
    """The sbatch script for ``job``."""
    t, cpus = tasks_per_node(job), cpus_per_task(job)
    s = job.slurm
    nodes = f"{job.nodes}-{job.max_nodes}" if job.elastic else str(job.nodes)
    opts = [f"--job-name={job.name}", f"--nodes={nodes}", f"--ntasks-per-node={t}", f"--cpus-per-task={cpus}"]
    if job.mem_per_proc:
        opts.append(f"--mem={mem_mib(job.mem_per_proc) * job.procs_per_node}M")
    if job.gpus_per_node:
        opts.append(f"--gres=gpu:{job.gpus_per_node}")
    if job.time:
        opts.append(f"--time={job.time}")
    opts += [f"--output={s.output}", "--open-mode=append"]
    if s.requeue:
        opts.append("--requeue")
    if s.signal_before_s > 0:
        opts.append(f"--signal=USR1@{s.signal_before_s}")
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            opts.append(f"--{key}={getattr(s, key)}")
    opts.append(f"--chdir={job.workdir or one_line('the current folder (--chdir)', os.getcwd())}")
    if job.elastic:
        opts.append("--no-kill")  # a failed node does not end the job
    opts += list(s.extra)
    lines = ["#!/bin/bash", f"# Written by `dtrain submit --slurm{' ' + comment(source) if source else ''}`: "
             f"{job.nodes_text()} node(s) x {job.procs_per_node} process(es), layout '{job.layout}'."]
    if job.elastic:
        lines.append(f"# Elastic: {ELASTIC_NOTE}. The rendezvous runs on the first node of the allocation.")
    # Every value was checked where the job was defined (jobspec); free text is quoted as sbatch reads it.
    lines += [f"#SBATCH {sbatch_arg(o)}" for o in opts]
    lines += ["", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job_env(job).items()]
    lines += list(s.setup)
    lines.append('echo "dtrain: job ${SLURM_JOB_ID} attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on ${SLURM_JOB_NODELIST}" >&2')
    if job.elastic:  # every node names the same endpoint: the allocation's first node
        # sed, not head: head leaves scontrol writing into a closed pipe (SIGPIPE; pipefail ends the script).
        lines.append('DTRAIN_MASTER="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"')
    lines += [_shell_line(srun_argv(job)), ""]
    return "\n".join(lines)


def submit(script: Path, *, wait: bool = False, env: dict[str, str] | None = None) -> tuple[int, int]:
    """``sbatch --parsable SCRIPT``; returns (job id, sbatch's exit status; with ``wait``, the job's)."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise ConfigError("sbatch not found on this machine; submit from a SLURM login node, or use --dry-run to only write the script.")
    argv = [exe, "--parsable", *(["--wait"] if wait else []), str(script)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    m = re.match(r"^(\d+)", r.stdout.strip())
    if m is None:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise LaunchError(f"sbatch refused the job (status {r.returncode}): {why[-1] if why else 'no message'}")
    return int(m.group(1)), r.returncode
