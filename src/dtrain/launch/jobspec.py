"""One job description for every scheduler: what to run, on how many nodes and processes.

    # job.toml
    name = "mnist"
    command = ["dtrain", "train", "--task", "mnist", "--data-dir", "/data/mnist"]   # or ["train.py", "--lr", "0.1"]
    nodes = 2                  # or "1:4": elastic, from 1 to 4 nodes (see sbatch.py and k8s.py for what each scheduler can do)
    procs_per_node = 4
    gpus_per_node = 4          # 0, or equal to procs_per_node: one process drives one GPU
    cpus_per_proc = 8
    mem_per_proc = "16G"
    time = "02:00:00"
    [env]
    NCCL_DEBUG = "WARN"
    [slurm]
    partition = "gpu"
    [k8s]
    image = "registry.example.com/me/train:1"

``dtrain submit --slurm job.toml`` and ``dtrain submit --k8s job.toml`` render it; both start
``dtrain`` inside (``dtrain run``/``dtrain train`` and the environment detection), so the training
script is the same everywhere.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError

LAYOUTS = ("node", "process")
#: Launch flags that the job description owns; written in ``command`` they would disagree with it.
_OWNED_FLAGS = ("-n", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-id")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_before_s: int = 90
    """Seconds before the time limit at which SLURM sends SIGUSR1: checkpoint, then requeue."""
    requeue: bool = True
    output: str = "%x-%j.out"
    """Log file (sbatch patterns); appended to across requeues."""
    setup: tuple[str, ...] = ()
    """Shell lines run before srun (``module load ...``, ``source .venv/bin/activate``)."""
    extra: tuple[str, ...] = ()
    """More sbatch options, e.g. ``"--exclusive"`` or ``"--constraint=a100"``."""


@dataclass(frozen=True, kw_only=True)
class K8sOptions:
    image: str | None = None
    namespace: str = "default"
    port: int = 29500
    """Rendezvous port on the master pod."""
    image_pull_policy: str | None = None
    backoff_limit: int = 3
    """Pod restarts the operator allows before the job fails."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str = "dtrain"
    command: tuple[str, ...] = ()
    """``dtrain train ...``, ``dtrain run SCRIPT ...`` or ``SCRIPT.py ...``; processes come from the fields below."""
    nodes: int = 1
    """Nodes of the job; with ``max_nodes``, the fewest it runs on."""
    max_nodes: int | None = None
    """``nodes = "MIN:MAX"`` in a job file: an elastic job (``--nnodes MIN:MAX``) of MIN to MAX nodes."""
    procs_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_proc: int = 1
    mem_per_proc: str | None = None
    """Memory of one process, e.g. ``"4G"`` or ``"512M"``."""
    time: str | None = None
    """Time limit in SLURM's forms: ``MINUTES``, ``HH:MM:SS``, ``D-HH:MM:SS``."""
    env: dict[str, str] = field(default_factory=dict)
    layout: str = "node"
    """``node``: one task per node running ``-n procs_per_node`` processes; ``process``: one task per process."""
    workdir: str | None = None
    dtrain: tuple[str, ...] = ("dtrain",)
    """How to start dtrain on the cluster, e.g. ``"python3 -m dtrain"``."""
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    k8s: K8sOptions = field(default_factory=K8sOptions)

    def __post_init__(self) -> None:
        for key in ("nodes", "procs_per_node", "cpus_per_proc"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}.")
        if self.gpus_per_node < 0:
            raise ConfigError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}.")
        if self.max_nodes is not None and self.max_nodes < self.nodes:
            raise ConfigError(f"nodes = \"{self.nodes}:{self.max_nodes}\" has MAX below MIN; write \"MIN:MAX\", e.g. \"1:4\".")
        if self.elastic and self.layout != "node":
            raise ConfigError(f"nodes = \"{self.nodes}:{self.max_nodes}\" needs layout 'node': one dtrain agent per node "
                              "joins and leaves the job (layout 'process' has no agent).")
        if self.gpus_per_node and self.gpus_per_node != self.procs_per_node:
            raise ConfigError(
                f"gpus_per_node {self.gpus_per_node} does not match procs_per_node {self.procs_per_node}; dtrain runs one "
                f"process per GPU: set procs_per_node = {self.gpus_per_node} (or gpus_per_node = {self.procs_per_node})."
            )
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}; choose one of: {', '.join(LAYOUTS)}.")
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", self.name):
            raise ConfigError(f"job name {self.name!r} may hold only letters, digits, '-', '_' and '.'; e.g. name = \"mnist-2n\".")
        if self.mem_per_proc is not None:
            mem_mib(self.mem_per_proc)
        if self.time is not None:
            time_seconds(self.time)
        for key in self.env:
            if not _ENV_KEY.match(key):
                raise ConfigError(f"environment variable name {key!r} is not valid; use letters, digits and '_'.")
        if not self.dtrain:
            raise ConfigError("dtrain = \"\" names no command; use e.g. dtrain = \"python3 -m dtrain\".")
        self.entry()

    # -- the command ------------------------------------------------------------------------
    def entry(self) -> tuple[str, list[str]]:
        """``(subcommand, args)``: ``("train", [...])`` or ``("run", [script, ...])``."""
        cmd = list(self.command)
        if not cmd:
            raise ConfigError('the job has no command; e.g. command = ["dtrain", "train", "--task", "mnist"] or ["train.py"].')
        if cmd[0] == "dtrain" or cmd[0].endswith("/dtrain"):
            cmd = cmd[1:]
        elif cmd[0].endswith(".py"):
            cmd = ["run", *cmd]
        else:
            raise ConfigError(
                f"command must start with `dtrain train`, `dtrain run` or a script.py, got {cmd[0]!r}; "
                'e.g. command = ["train.py", "--lr", "0.1"].'
            )
        if not cmd or cmd[0] not in ("train", "run"):
            raise ConfigError(f"command runs `dtrain {cmd[0] if cmd else ''}`; a job runs `dtrain train` or `dtrain run SCRIPT`.")
        sub, args = cmd[0], cmd[1:]
        own = sorted({a.split("=")[0] for a in args[: _script_index(sub, args)]} & set(_OWNED_FLAGS))
        if own:
            raise ConfigError(f"command sets {', '.join(own)}; the job description owns them: use nodes and procs_per_node.")
        if sub == "run" and _script_index(sub, args) >= len(args):
            raise ConfigError("command `dtrain run` names no script; e.g. command = [\"dtrain\", \"run\", \"train.py\"].")
        return sub, args

    def task_argv(self, launch_flags: list[str]) -> list[str]:
        """The argv of one scheduler task: dtrain, the subcommand, ``launch_flags``, the rest."""
        sub, args = self.entry()
        return [*self.dtrain, sub, *launch_flags, *args]

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        """Nodes may leave and join (``nodes = "MIN:MAX"``)."""
        return self.max_nodes is not None

    def nodes_text(self) -> str:
        """``"2"``, or ``"1:4"`` for an elastic job."""
        return f"{self.nodes}:{self.max_nodes}" if self.elastic else str(self.nodes)


def parse_nodes(value: Any, where: str = "nodes") -> tuple[int, int | None]:
    """``nodes``: a number, or ``"MIN:MAX"`` for an elastic job; returns (MIN, MAX or None)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None
    text = str(value).strip()
    low, sep, high = text.partition(":")
    if low.isdigit() and (not sep or high.isdigit()):
        return int(low), (int(high) if sep else None)
    raise ConfigError(f"{where} {value!r} is not a number of nodes or \"MIN:MAX\"; write e.g. nodes = 2 or nodes = \"1:4\".")


def _script_index(sub: str, args: list[str]) -> int:
    """Where `dtrain run`'s script is in ``args`` (flags before it are dtrain's own)."""
    if sub != "run":
        return len(args)
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1 if "=" in args[i] or args[i] in ("-v", "--verbose", "--debug") else 2
    return i


def mem_mib(text: str) -> int:
    """``"4G"`` -> 4096 (MiB); a plain number is MiB, as in SLURM."""
    m = _MEM.match(str(text).strip())
    if not m:
        raise ConfigError(f"mem_per_proc {text!r} is not a size; write e.g. \"4G\" or \"512M\".")
    value, unit = float(m.group(1)), m.group(2).upper()
    mib = value * {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
    if mib < 1:
        raise ConfigError(f"mem_per_proc {text!r} is less than 1 MiB.")
    return int(round(mib))


def time_seconds(text: str) -> int:
    """SLURM's time forms (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in seconds."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ConfigError(f"time {text!r} is not a time limit; write e.g. \"02:00:00\", \"90\" (minutes) or \"1-00:00:00\".")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        total = int(days) * 86400 + h * 3600 + mi * 60 + s
    elif len(parts) == 3:
        total = parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif len(parts) == 2:
        total = parts[0] * 60 + parts[1]
    else:
        total = parts[0] * 60
    if total <= 0:
        raise ConfigError(f"time {text!r} is zero; give a positive time limit.")
    return total


def load(path: str | Path) -> JobSpec:
    """Read a job description from a TOML file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"job file {p} does not exist; give the path of a job TOML file.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job file {p} is not valid TOML ({exc}).") from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, a binary file
        raise ConfigError(f"job file {p} cannot be read as text ({type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}); give a job TOML file.") from None
    return from_dict(data, where=str(p))


def from_dict(data: dict[str, Any], *, where: str = "job") -> JobSpec:
    data = dict(data)
    slurm = _section(SlurmOptions, data.pop("slurm", {}), f"{where} [slurm]")
    k8s = _section(K8sOptions, data.pop("k8s", {}), f"{where} [k8s]")
    top = _coerce(JobSpec, data, where)
    return JobSpec(**top, slurm=slurm, k8s=k8s)


def _section(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table.")
    return cls(**_coerce(cls, data, where))


def _coerce(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(cls) if f.name not in ("slurm", "k8s", "max_nodes")}
    if cls is JobSpec and "nnodes" in data:
        raise ConfigError(f"{where}: a job file says nodes, not nnodes; write nodes = {json.dumps(data['nnodes'])} "
                          "(a number, or \"MIN:MAX\" for an elastic job).")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}.")
    out = dict(data)
    for key in ("command", "dtrain", "setup", "extra"):
        if key in out:
            value = out[key]
            out[key] = tuple(shlex.split(value)) if isinstance(value, str) and key in ("command", "dtrain") else (
                (value,) if isinstance(value, str) else tuple(str(v) for v in value))
    if "env" in out:
        if not isinstance(out["env"], dict):
            raise ConfigError(f"{where}: env must be a table of NAME = \"value\".")
        out["env"] = {str(k): str(v) for k, v in out["env"].items()}
    for key in ("mem_per_proc", "time"):
        if key in out and out[key] is not None:
            out[key] = str(out[key])
    if cls is JobSpec and "nodes" in out:
        out["nodes"], out["max_nodes"] = parse_nodes(out["nodes"], f"{where}: nodes")
    for f in fields(cls):
        if f.name in out and f.type in ("int",) and not isinstance(out[f.name], int):
            raise ConfigError(f"{where}: {f.name} must be an integer, got {out[f.name]!r}.")
    return out


def with_overrides(job: JobSpec, **values: Any) -> JobSpec:
    """``job`` with the given fields replaced (None: keep); section fields as ``slurm_partition=``, ``k8s_image=``;
    ``nodes`` may be ``"MIN:MAX"``."""
    top = {k: v for k, v in values.items() if v is not None and not k.startswith(("slurm_", "k8s_"))}
    if "nodes" in top:
        top["nodes"], top["max_nodes"] = parse_nodes(top["nodes"], "--nodes")
    slurm = {k[6:]: v for k, v in values.items() if v is not None and k.startswith("slurm_")}
    k8s = {k[4:]: v for k, v in values.items() if v is not None and k.startswith("k8s_")}
    return replace(job, **top, slurm=replace(job.slurm, **slurm), k8s=replace(job.k8s, **k8s))
