"""Run settings handed from a launcher to its workers: one frozen value in sections, read in one place.

A launcher hands its workers settings through the environment (``dtrain run --comm`` sets
``DTRAIN_COMM``, ``--stall-timeout`` sets ``DTRAIN_STALL_TIMEOUT``), and users may set the same
variables by hand (``DTRAIN_DEBUG=1``, ``DTRAIN_STALL_TIMEOUT=60``). This module is the only reader
and the only writer of ``DTRAIN_*`` variables:

    current().diag.stall_timeout           # 900.0: every section, parsed once per process
    section(TestHooks).fake_gpus           # one section alone
    launch_link().launch_dir               # the launcher's folder; never fails (error paths need it)
    hand_over(diag={"debug": True})        # a launcher: its workers see DTRAIN_DEBUG=1

Each section validates itself; ``Options.from_env`` / ``Options.to_env`` map it to the variables.
``dtrain.init``'s own arguments win over these.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from . import _check as check
from .errors import ConfigError

LAUNCH_DIR_ENV = "DTRAIN_LAUNCH_DIR"
"""Also the mark a launcher finds its own workers by, in their ``/proc/PID/environ``."""


def _setting(var: str, default: Any, parse: Callable[[str, str], Any], types: tuple[type, ...],
             show: Callable[[Any], str] = str) -> Any:
    """A field read from ``var`` (unset or empty: ``default``) by ``parse(var, text)``, written back by ``show``."""
    return field(default=default, metadata={"env": var, "parse": parse, "types": types, "show": show})


class _Section:
    """What every section does: read its variables, write them back, check its fields' types."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value, types = getattr(self, f.name), f.metadata["types"]
            if value != f.default and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                raise ConfigError(f"run option {f.name} ({f.metadata['env']}) got {type(value).__name__} {value!r}; "
                                  f"give a {' or '.join(t.__name__ for t in types)}.")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Any:
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            text = env.get(f.metadata["env"])
            if text:
                values[f.name] = f.metadata["parse"](f.metadata["env"], text)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables of the settings that differ from their defaults."""
        return {f.metadata["env"]: f.metadata["show"](getattr(self, f.name))
                for f in fields(self) if getattr(self, f.name) != f.default}  # type: ignore[arg-type]

    @classmethod
    def variables(cls) -> tuple[str, ...]:
        return tuple(f.metadata["env"] for f in fields(cls))  # type: ignore[arg-type]


# -- how each kind of value is read from its variable ----------------------------------------------

def _seconds(var: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{var}={text!r} is not a number of seconds; set it to e.g. 900, or unset it.") from None


def _bound(var: str, text: str) -> float | None:
    value = _seconds(var, text)
    return check.startup_seconds(var, value) if value else None  # 0: the default bound


def _steps(var: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{var}={text!r} is not a number of steps.") from None


def _flag(var: str, text: str) -> bool:
    return text != "0"


def _text(var: str, text: str) -> str:
    return text


def _oom(var: str, text: str) -> tuple[int, int, int | None]:
    rank, _, size = text.partition(":")
    size, at, step = size.partition("@")
    units = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
    number = size.rstrip("kmgibKMGIB")
    unit = units.get(size[len(number):].lower())
    if not rank.isdigit() or not number.isdigit() or unit is None or int(number) == 0 or (at and not step.isdigit()):
        raise ConfigError(f"{var}={text!r} is not RANK:BYTES[@STEP]; give e.g. {var}=1:64MiB (that rank's --micro-batch auto "
                          "trials run out of memory above 64 MiB) or 1:64MiB@5 (its training steps, from step 5 on).")
    return int(rank), int(number) * unit, int(step) if at else None


def _gpus(var: str, text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"{var}={text!r} is not a number of GPUs; give e.g. {var}=1.")
    return int(text)


def _pid(var: str, text: str) -> int:
    return int(text) if text.isdigit() else 0  # tolerant: a worker's error path reads it


# -- the sections ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Diagnostics(_Section):
    stall_timeout: float = _setting("DTRAIN_STALL_TIMEOUT", 900.0, _seconds, (int, float), repr)
    """Seconds without progress before the watchdog stops the job (0: off; ``--stall-timeout``)."""
    debug: bool = _setting("DTRAIN_DEBUG", False, _flag, (bool,), lambda on: "1" if on else "0")
    """Check every dtrain collective across ranks (set and not ``0``; ``--debug``)."""
    run_dir: str = _setting("DTRAIN_RUN_DIR", "dtrain-run", _text, (str,))
    """Where stall dumps go (``--run-dir``)."""


@dataclass(frozen=True, kw_only=True)
class CommOptions(_Section):
    method: str | None = _setting("DTRAIN_COMM", None, _text, (str,))
    """How DDP's gradients travel (``dtrain run --comm``), as the launcher checked and wrote it."""
    warmup: int | None = _setting("DTRAIN_COMM_WARMUP", None, _steps, (int,))
    """Plain all-reduce steps before the comm method starts (``--comm-warmup``)."""


@dataclass(frozen=True, kw_only=True)
class Layout(_Section):
    parallel: str | None = _setting("DTRAIN_PARALLEL", None, _text, (str,))
    """How ranks split (``dtrain run --parallel dp_shard=2,tp=2``)."""


@dataclass(frozen=True, kw_only=True)
class Startup(_Section):
    timeout: float | None = _setting("DTRAIN_STARTUP_TIMEOUT", None, _bound, (int, float), repr)
    """Seconds each start-up wait may take (``--startup-timeout``; None: 120)."""


@dataclass(frozen=True, kw_only=True)
class TestHooks(_Section):
    """Faults and slowness on demand, for fault-tolerance, straggler and device-count tests."""

    __test__: ClassVar[bool] = False  # not a pytest test class
    plugin: str | None = _setting("DTRAIN_PLUGIN", None, _text, (str,))
    """``MODULE``: each worker of ``dtrain train`` imports it and adds its ``listeners(ctx)`` to the
    loop's (``dtrain.train.listeners.plugin``): the tests' fault and slowness drivers (tests/support/faults.py, slowdown.py)."""
    oom_inject: tuple[int, int, int | None] | None = _setting(
        "DTRAIN_OOM_INJECT", None, _oom, (tuple,), lambda v: f"{v[0]}:{v[1]}" + (f"@{v[2]}" if v[2] is not None else ""))
    """``RANK:BYTES``: that rank's ``--micro-batch auto`` trials run out of memory above BYTES
    (``dtrain.train.microbatch.Budget``; a fake device for a CPU); ``RANK:BYTES@STEP``: its training
    micro-steps from step STEP on instead (``dtrain.train.microretry``)."""
    fake_gpus: int | None = _setting("DTRAIN_FAKE_GPUS", None, _gpus, (int,))
    """``N``: ``dtrain.launch.preflight.cuda_device_count`` says N, so the checks of ranks against
    GPUs run on a machine without one."""


@dataclass(frozen=True, kw_only=True)
class LaunchLink(_Section):
    """What binds a worker to the launcher that started it; read without ever failing."""

    launcher_pid: int = _setting("DTRAIN_LAUNCHER_PID", 0, _pid, (int,))
    """The launcher whose death must end this worker (0: none)."""
    launch_dir: str | None = _setting(LAUNCH_DIR_ENV, None, _text, (str,))
    """The launcher's private folder: worker pid files, error reports, the stop marker, hvd.elastic commits."""
    elastic: str | None = _setting("DTRAIN_ELASTIC", None, _text, (str,))
    """``run id@endpoint`` of an elastic job (``--nnodes MIN:MAX``), set by its launcher."""
    local_rank_arg: str | None = _setting("DTRAIN_LOCAL_RANK_ARG", None, _text, (str,))
    """The ``--local_rank`` spelling to pass each script worker (``dtrain run --local-rank-arg``)."""


@dataclass(frozen=True, kw_only=True)
class FaultToleranceLink(_Section):
    """What makes a script's process one replica group of a fault-tolerant job (``dtrain run
    --fault-tolerance`` sets them; ``dtrain.init`` then joins the job, see ``dtrain.context.replicas``)."""

    spec: str | None = _setting("DTRAIN_FT", None, _text, (str,))
    """``--fault-tolerance``'s settings, ``min=M,heartbeat=S,...`` (``dtrain.ft.FaultTolerance.parse``)."""
    lighthouse: str | None = _setting("DTRAIN_FT_LIGHTHOUSE", None, _text, (str,))
    """The job's Lighthouse, ``http://HOST:PORT``."""
    replica_id: str | None = _setting("DTRAIN_FT_REPLICA", None, _text, (str,))
    """This replica group's id (stable across its restarts)."""
    restart: bool = _setting("DTRAIN_FT_RESTART", False, _flag, (bool,), lambda on: "1" if on else "0")
    """Its launcher started this group again after it died (``dtrain.context.replicas``: alone, it does not train the job again)."""


SECTIONS: dict[str, type[_Section]] = {"diag": Diagnostics, "comm": CommOptions, "layout": Layout, "startup": Startup,
                                       "testing": TestHooks, "link": LaunchLink, "ft": FaultToleranceLink}


@dataclass(frozen=True, kw_only=True)
class Options:
    diag: Diagnostics = field(default_factory=Diagnostics)
    comm: CommOptions = field(default_factory=CommOptions)
    layout: Layout = field(default_factory=Layout)
    startup: Startup = field(default_factory=Startup)
    testing: TestHooks = field(default_factory=TestHooks)
    link: LaunchLink = field(default_factory=LaunchLink)
    ft: FaultToleranceLink = field(default_factory=FaultToleranceLink)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            check.instance(f"Options({name}=...)", getattr(self, name), cls, f"give a {cls.__name__}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Options:
        """The settings in ``env`` (default ``os.environ``); ConfigError names a malformed one."""
        env = os.environ if env is None else env
        return cls(**{name: section.from_env(env) for name, section in SECTIONS.items()})

    def to_env(self) -> dict[str, str]:
        """The ``DTRAIN_*`` variables that hand these settings to a worker (the non-default ones)."""
        return {k: v for name in SECTIONS for k, v in getattr(self, name).to_env().items()}


# -- the one reader: parsed once per process --------------------------------------------------------

_parsed: dict[type, tuple[tuple[str | None, ...], Any]] = {}


def section(cls: type[_Section]) -> Any:
    """One section as os.environ gives it, parsed once (and again only when one of its variables
    changed: a launcher that hands settings over, a test)."""
    key = tuple(os.environ.get(v) for v in cls.variables())
    hit = _parsed.get(cls)
    if hit is None or hit[0] != key:
        hit = _parsed[cls] = (key, cls.from_env(os.environ))
    return hit[1]


def current() -> Options:
    """This process's options, every section (ConfigError names a malformed variable)."""
    return Options(**{name: section(cls) for name, cls in SECTIONS.items()})


def launch_link() -> LaunchLink:
    """The launch link alone: a worker's error path needs it even when another setting is malformed."""
    return section(LaunchLink)


# -- the one writer ---------------------------------------------------------------------------------

def hand_over(**changes: Mapping[str, Any]) -> dict[str, str | None]:
    """Hand settings to the workers this process starts (they inherit its environment):
    ``hand_over(diag={"debug": True}, comm={"method": "fp16"})`` checks the given fields (as their
    section does) and writes their variables (a default value: the variable is removed); other
    variables, the user's own among them, stay. Returns each written variable's previous value."""
    previous: dict[str, str | None] = {}
    for name, values in changes.items():
        cls = SECTIONS[name]
        written = cls(**values).to_env()
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in values:
                var = f.metadata["env"]
                previous.setdefault(var, os.environ.get(var))
                _put(var, written.get(var))
    return previous


@contextlib.contextmanager
def handed_over(**changes: Mapping[str, Any]) -> Iterator[None]:
    """``hand_over`` for the span of one launch; the variables it wrote are put back after."""
    previous = hand_over(**changes)
    try:
        yield
    finally:
        put_back(previous)


def put_back(previous: Mapping[str, str | None]) -> None:
    """Undo ``hand_over``: each variable as it was (``previous``, what hand_over returned)."""
    for var, value in previous.items():
        _put(var, value)


def _put(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value
