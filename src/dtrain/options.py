"""The ``DTRAIN_*`` environment settings, read in one place into one frozen value.

Launchers hand settings to their workers through the environment (``dtrain run --comm`` sets
``DTRAIN_COMM``, ``--stall-timeout`` sets ``DTRAIN_STALL_TIMEOUT``); no other module reads a
``DTRAIN_*`` variable. ``dtrain.init``'s own arguments win over these.

    Options.from_env()   # Options(stall_timeout=900.0, debug=False, run_dir='dtrain-run', comm=None, ...)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

LAUNCHER_PID_ENV = "DTRAIN_LAUNCHER_PID"
LAUNCH_DIR_ENV = "DTRAIN_LAUNCH_DIR"


@dataclass(frozen=True, kw_only=True)
class Options:
    stall_timeout: float = 900.0
    """``DTRAIN_STALL_TIMEOUT``: seconds without progress before the watchdog stops the job (0: off)."""
    debug: bool = False
    """``DTRAIN_DEBUG``: check every dtrain collective across ranks (set and not ``0``)."""
    run_dir: str = "dtrain-run"
    """``DTRAIN_RUN_DIR``: where stall dumps go."""
    comm: str | None = None
    """``DTRAIN_COMM``: how DDP's gradients travel (``dtrain run --comm``)."""
    comm_warmup: int | None = None
    """``DTRAIN_COMM_WARMUP``: plain all-reduce steps before the comm method starts."""
    parallel: str | None = None
    """``DTRAIN_PARALLEL``: how ranks split (``dtrain run --parallel dp_shard=2,tp=2``)."""
    fault_inject: tuple[int, int] | None = None
    """``DTRAIN_FAULT_INJECT=RANK:STEP``: that rank kills itself after that step (fault-tolerance tests)."""
    elastic: str | None = None
    """``DTRAIN_ELASTIC``: ``run id@endpoint`` of an elastic job (``--nnodes MIN:MAX``), set by its launcher."""
    startup_timeout: float | None = None
    """``DTRAIN_STARTUP_TIMEOUT``: seconds each start-up wait may take (``--startup-timeout``; None: 120)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Options:
        """The settings in ``env`` (default ``os.environ``); ConfigError names a malformed one."""
        env = os.environ if env is None else env
        return cls(
            stall_timeout=_seconds(env, "DTRAIN_STALL_TIMEOUT", 900.0),
            debug=env.get("DTRAIN_DEBUG", "") not in ("", "0"),
            run_dir=env.get("DTRAIN_RUN_DIR") or "dtrain-run",
            comm=env.get("DTRAIN_COMM") or None,
            comm_warmup=_steps(env, "DTRAIN_COMM_WARMUP"),
            parallel=env.get("DTRAIN_PARALLEL") or None,
            fault_inject=_fault(env.get("DTRAIN_FAULT_INJECT")),
            elastic=env.get("DTRAIN_ELASTIC") or None,
            startup_timeout=_seconds(env, "DTRAIN_STARTUP_TIMEOUT", 0.0) or None,
        )


FAKE_GPUS_ENV = "DTRAIN_FAKE_GPUS"


def fake_gpu_count(env: Mapping[str, str] | None = None) -> int | None:
    """``DTRAIN_FAKE_GPUS=N``: a test hook that makes ``dtrain.launch.preflight.cuda_device_count`` say N, so the
    checks of ranks against GPUs can be tested on a machine without one; None when unset."""
    env = os.environ if env is None else env
    text = env.get(FAKE_GPUS_ENV)
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"{FAKE_GPUS_ENV}={text!r} is not a number of GPUs; give e.g. {FAKE_GPUS_ENV}=1.")
    return int(text)


def launcher_link(env: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """``(DTRAIN_LAUNCHER_PID, DTRAIN_LAUNCH_DIR)``: the launcher whose death must end this
    worker (0: none) and its private folder (worker pid files, error reports). Read apart from
    ``Options`` because a worker's error path needs them even when another setting is malformed."""
    env = os.environ if env is None else env
    raw = env.get(LAUNCHER_PID_ENV) or "0"
    return (int(raw) if raw.isdigit() else 0), (env.get(LAUNCH_DIR_ENV) or None)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; set it to e.g. 900, or unset it.") from None


def _steps(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of steps.") from None


def _fault(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        rank, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ConfigError(f"DTRAIN_FAULT_INJECT={spec!r} is not RANK:STEP (e.g. 1:25).") from None
    return rank, step
