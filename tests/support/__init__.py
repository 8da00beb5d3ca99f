"""The harness that only dtrain's tests and benchmarks use; it is not part of the package (the wheel
holds src/ only). Import it as ``tests.support`` with the repository's root on ``sys.path`` (pytest
puts it there; a benchmark inserts it):

    from tests.support import run_cli, run_distributed
    from tests.support.netbed import NetBed            # the network test bed (root, iproute2)
    python -m tests.support.netbed --check             # from the repository's root

``run_distributed`` (N gloo ranks in spawned processes) is the product's own
``dtrain.launch.local.run_distributed``, re-exported here so that tests have one place to import from.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Sequence

import dtrain
from dtrain.launch.local import DistributedTestError, exception_line, run_distributed

SRC = os.path.dirname(os.path.dirname(os.path.abspath(dtrain.__file__)))
"""The folder this process imports dtrain from (a worktree's src/, not another install)."""


def run_cli(args: Sequence[str], *, timeout: float = 300.0, cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m dtrain ARGS`` and capture its output; a hang fails after ``timeout`` s."""
    # The child imports the same dtrain as this process.
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, full_env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "dtrain", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
    )


def run_ckpt(*args: object) -> tuple[int, str]:
    """``dtrain ckpt ARGS`` in this process, for a test that only checks files with it (a
    subprocess costs an interpreter start, ~3 s on 2 busy cores): its exit status and stdout."""
    from dtrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ckpt", *map(str, args)])
    return code, out.getvalue()


def run_cli_here(argv: Sequence[str]) -> int:
    """``dtrain ARGS`` in this process, for input refused before any process starts: its exit status
    (argparse's usage errors included). The environment is restored after: the CLI hands flags to
    workers through it."""
    from dtrain.cli import main

    env = dict(os.environ)
    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code  # type: ignore[return-value]
    finally:
        os.environ.clear()
        os.environ.update(env)


__all__ = ["SRC", "DistributedTestError", "exception_line", "run_ckpt", "run_cli", "run_cli_here", "run_distributed"]
