"""One job description for every scheduler: what to run, on how many nodes and processes (a
``job.toml``; docs/clusters.md has an example and every key).

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
from . import jobvalues as jv

LAYOUTS = ("node", "process")
#: Launch flags that the job description owns; written in ``command`` they would disagree with it.
_OWNED_FLAGS = ("-n", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-id")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_MEM = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", re.IGNORECASE)
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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

    def __post_init__(self) -> None:
        jv.check_types(self, "[slurm] ")
        for key in ("partition", "account", "qos"):
            if getattr(self, key) is not None:
                jv.slurm_name(f"[slurm] {key}", getattr(self, key), several=key == "partition")
        jv.in_range("[slurm] signal_before_s", self.signal_before_s, 0, 65535,
                    "give the seconds before the time limit at which SLURM sends SIGUSR1 (0: none), e.g. 90")
        jv.not_empty("[slurm] output", jv.one_line("[slurm] output", self.output))
        for i, option in enumerate(self.extra):
            jv.sbatch_option(f"[slurm] extra[{i}]", option)


@dataclass(frozen=True, kw_only=True)
class K8sOptions:
    image: str | None = None
    namespace: str = "default"
    port: int = 29500
    """Rendezvous port on the master pod."""
    image_pull_policy: str | None = None
    backoff_limit: int = 3
    """Pod restarts the operator allows before the job fails."""

    def __post_init__(self) -> None:
        jv.check_types(self, "[k8s] ")
        if self.image and any(c.isspace() for c in jv.one_line("[k8s] image", self.image)):
            raise ConfigError(f"[k8s] image {jv.shown(self.image)} holds a space; give an image reference such as "
                              '"registry.example.com/me/train:1".')
        jv.dns_label("[k8s] namespace", self.namespace)
        jv.in_range("[k8s] port", self.port, 1, 65535, "give the rendezvous port, e.g. port = 29500")
        if self.image_pull_policy is not None and self.image_pull_policy not in jv.PULL_POLICIES:
            raise ConfigError(f"[k8s] image_pull_policy {jv.shown(self.image_pull_policy)} is not one of Kubernetes' "
                              f"policies; choose one of: {', '.join(jv.PULL_POLICIES)}.")
        jv.in_range("[k8s] backoff_limit", self.backoff_limit, 0, 2**31 - 1, "give the pod restarts the job may take, e.g. 3")


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
        jv.check_types(self)
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
            raise ConfigError(f"unknown layout {jv.shown(self.layout)}; choose one of: {', '.join(LAYOUTS)}.")
        if not _JOB_NAME.fullmatch(self.name):
            raise ConfigError(f"job name {jv.shown(self.name)} may hold only letters, digits, '-', '_' and '.'; "
                              'e.g. name = "mnist-2n".')
        if self.mem_per_proc is not None:
            mem_mib(self.mem_per_proc)
        if self.time is not None:
            time_seconds(self.time)
        self._check_text()
        if not self.dtrain:
            raise ConfigError("dtrain = \"\" names no command; use e.g. dtrain = \"python3 -m dtrain\".")
        self.entry()

    def _check_text(self) -> None:
        """Free text that the scripts quote: one line each; environment names as the shell takes them."""
        for key in ("command", "dtrain"):
            for i, arg in enumerate(getattr(self, key)):
                jv.one_line(f"{key}[{i}]", arg)
        for key, value in self.env.items():
            jv.env_key("[env]", key)
            jv.one_line(f"[env] {key}", value)
        if self.workdir is not None:
            jv.not_empty("workdir", jv.one_line("workdir", self.workdir))

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
    if low.isdecimal() and (not sep or high.isdecimal()):
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
    m = _MEM.fullmatch(str(text).strip())
    if not m:
        raise ConfigError(f"mem_per_proc {jv.shown(text)} is not a size; write e.g. \"4G\" or \"512M\".")
    value, unit = float(m.group(1)), m.group(2).upper()
    mib = value * {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
    if mib < 1:
        raise ConfigError(f"mem_per_proc {jv.shown(text)} is less than 1 MiB.")
    return int(round(mib))


def time_seconds(text: str) -> int:
    """SLURM's time forms (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in seconds."""
    m = _TIME.fullmatch(str(text))  # not stripped: the text goes into the script as it is
    if not m:
        raise ConfigError(f"time {jv.shown(text)} is not a time limit; write e.g. \"02:00:00\", \"90\" (minutes) or \"1-00:00:00\".")
    days, *rest = m.groups()
    parts = [int(x) for x in rest if x is not None]
    units = (3600, 60, 1) if days is not None or len(parts) == 3 else (60, 1)  # D-HH[:MM[:SS]], HH:MM:SS; MM[:SS]
    total = int(days or 0) * 86400 + sum(p * u for p, u in zip(parts, units))
    if total <= 0:
        raise ConfigError(f"time {jv.shown(text)} is zero; give a positive time limit.")
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
    """The job of a parsed TOML file, validated; every mistake is one line that starts with ``where``."""
    data = dict(data)
    try:
        slurm = _section(SlurmOptions, data.pop("slurm", {}), "[slurm]")
        k8s = _section(K8sOptions, data.pop("k8s", {}), "[k8s]")
        return JobSpec(**_coerce(JobSpec, data), slurm=slurm, k8s=k8s)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _section(cls: type, data: Any, name: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a table, got {jv.shown(data)}; write {name} on a line of its own, its keys below.")
    return cls(**_coerce(cls, data))


def _coerce(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """TOML's values in the fields' shapes (a command string split into words, numbers of ``[env]``
    as strings); the types themselves are checked by the dataclass."""
    known = {f.name for f in fields(cls) if f.name not in ("slurm", "k8s", "max_nodes")}
    if cls is JobSpec and "nnodes" in data:
        raise ConfigError(f"a job file says nodes, not nnodes; write nodes = {json.dumps(data['nnodes'])} "
                          "(a number, or \"MIN:MAX\" for an elastic job).")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}.")
    out = dict(data)
    for key in ("command", "dtrain", "setup", "extra"):
        if key in out:
            out[key] = _words(key, out[key])
    if "env" in out and isinstance(out["env"], dict):  # NCCL_IB_TIMEOUT = 22 means the string "22"
        out["env"] = {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out["env"].items()}
    for key in ("mem_per_proc", "time"):  # time = 90: minutes
        if isinstance(out.get(key), (int, str)) and not isinstance(out[key], bool):
            out[key] = str(out[key]).strip()
    if cls is JobSpec and "nodes" in out:
        out["nodes"], out["max_nodes"] = parse_nodes(out["nodes"], "nodes")
    return out


def _words(key: str, value: Any) -> Any:
    """A list as a tuple; a string as its words (``command``, ``dtrain``) or as one item; anything
    else as it is, for the type check to name."""
    if isinstance(value, list):
        return tuple(value)
    if not isinstance(value, str):
        return value
    return split_words(key, value) if key in ("command", "dtrain") else (value,)


def split_words(what: str, text: str) -> tuple[str, ...]:
    """``text`` split into words as the shell would (``command = "train.py --lr 0.1"``, ``--dtrain-cmd``)."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:  # an unclosed quote
        example = '["train.py", "--lr", "0.1"]' if what == "command" else '["python3", "-m", "dtrain"]'
        listed = "" if what.startswith("-") else f", or write a list, e.g. {what} = {example}"
        raise ConfigError(f"{what} {jv.shown(text)} cannot be split into words ({str(exc).lower()}); close the quote"
                          f"{listed}.") from None


def with_overrides(job: JobSpec | None, **values: Any) -> JobSpec:
    """``job`` with the given fields replaced (None: keep); section fields as ``slurm_partition=``, ``k8s_image=``;
    ``nodes`` may be ``"MIN:MAX"``. ``job`` None: a job of the given fields alone (no job file)."""
    top = {k: v for k, v in values.items() if v is not None and not k.startswith(("slurm_", "k8s_"))}
    if "nodes" in top:
        top["nodes"], top["max_nodes"] = parse_nodes(top["nodes"], "--nodes")
    job = job if job is not None else JobSpec(**top)
    slurm = {k[6:]: v for k, v in values.items() if v is not None and k.startswith("slurm_")}
    k8s = {k[4:]: v for k, v in values.items() if v is not None and k.startswith("k8s_")}
    return replace(job, **top, slurm=replace(job.slurm, **slurm), k8s=replace(job.k8s, **k8s))
