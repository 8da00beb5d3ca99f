"""What ``dtrain train --fault-tolerance [min=M,...]`` asks for, checked where it is defined.

    FaultTolerance.parse("min=2,heartbeat=2")   # FaultTolerance(min_replicas=2, heartbeat_s=2.0, ...)

The settings go to torchft's Lighthouse (``min_replicas``, its heartbeat timeout, its join
timeout) and Manager (the quorum timeout: how long a replica group waits for a quorum before it
stops with one line).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _check as check
from ..errors import ConfigError, DtrainError

DEFAULT_LIGHTHOUSE_PORT = 29510
"""The Lighthouse's port on the first node when ``--lighthouse`` is not given (torchft's own default)."""


LEFT_EXIT = 143
"""Exit status of a replica group that left the job on a stop signal (128 + SIGTERM, as a shell
reports it): its launcher does not restart it, and the other groups go on."""


class FaultToleranceStopped(DtrainError):
    """The job cannot go on: no quorum (the Lighthouse is gone, or fewer than ``min`` replica groups are up)."""

    exit_code = 1


_KEYS = {"min": "min_replicas", "heartbeat": "heartbeat_s", "join": "join_s", "timeout": "quorum_timeout_s",
         "step-timeout": "step_timeout_s"}
"""``--fault-tolerance``'s keys and the fields they set."""


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    min_replicas: int = 1
    """The fewest replica groups that may commit a step (``min=M``); fewer: no step, and after
    ``quorum_timeout_s`` a clean stop."""
    heartbeat_s: float = 2.0
    """A replica group silent this long is out of the quorum (``heartbeat=S``): the survivors'
    next step waits about this long after a node is lost."""
    join_s: float = 1.0
    """How long a quorum waits for replica groups that are up but have not asked yet (``join=S``)."""
    quorum_timeout_s: float = 60.0
    """How long a replica group waits for a quorum before it stops (``timeout=S``)."""
    step_timeout_s: float = 30.0
    """How long one cross-replica collective or a healing transfer may take (``step-timeout=S``)."""

    @property
    def connect_s(self) -> float:
        """How long the members of a new quorum may take to reach its store and each other (torchft's
        process group configure) before the step is given up and the next quorum asked for: a member
        that has not is dead, as the Lighthouse takes one silent for ``heartbeat_s``; the second more
        covers one that died just after the quorum formed (its heartbeat expires that much later), so
        the next quorum leaves it out. Doubled after a failed try (``dtrain.ft.process_group``),
        never over ``step_timeout_s``."""
        return min(self.step_timeout_s, self.heartbeat_s + 1.0)

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError(f"--fault-tolerance min must be >= 1, got {self.min_replicas}; write e.g. --fault-tolerance min=1.")
        for key, name in list(_KEYS.items())[1:]:  # the times
            if not getattr(self, name) > 0:
                raise ConfigError(f"--fault-tolerance {key} must be > 0 seconds, got {getattr(self, name)}.")

    @classmethod
    def parse(cls, text: str | None) -> FaultTolerance:
        """``min=M,heartbeat=S,join=S,timeout=S,step-timeout=S`` (each optional; empty: the defaults)."""
        values: dict[str, float | int] = {}
        for part in filter(None, (text or "").split(",")):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in _KEYS:
                raise ConfigError(f"--fault-tolerance {text!r}: {part!r} is not one of {', '.join(k + '=...' for k in _KEYS)}; "
                                  "write e.g. --fault-tolerance min=2.")
            key = key.strip()
            try:
                values[_KEYS[key]] = int(value) if key == "min" else float(value)
            except ValueError:
                kind = "a whole number" if key == "min" else "a number of seconds"
                raise ConfigError(f"--fault-tolerance {key}={value!r} is not {kind}; write e.g. {key}=2.") from None
        return cls(**values)  # type: ignore[arg-type]

    def to_text(self) -> str:
        """The settings as ``parse`` reads them (a launcher hands them to its groups so)."""
        return ",".join(f"{key}={getattr(self, name):g}" for key, name in _KEYS.items())


def lighthouse_address(text: str) -> str:
    """``--lighthouse HOST:PORT`` (or ``http://HOST:PORT``) as torchft's clients take it."""
    bare = text.removeprefix("http://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--lighthouse {text!r} is not HOST:PORT; write e.g. --lighthouse 10.0.0.1:{DEFAULT_LIGHTHOUSE_PORT}.")
    check.host("--lighthouse", host.strip("[]"))
    return f"http://{host}:{port}"


def require_torchft() -> None:
    """torchft importable, or one line that says how to install it."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--fault-tolerance needs torchft, which does not import here ({exc}); "
                          "install it with pip install 'dtrain[ft]' (or pip install torchft).") from None
