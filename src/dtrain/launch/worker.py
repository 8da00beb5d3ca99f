"""``python -m dtrain.launch.worker SCRIPT [ARGS...]``: how the torchrun launcher starts a user's
script, so the worker binds to its launcher (``lifecycle``) before the script's first line."""

from __future__ import annotations

import sys

from .lifecycle import run_worker
from .runner import run_script


def main() -> None:
    # As under `python SCRIPT`: the script's folder leads sys.path, not the current directory
    # that `-m` put there.
    if sys.path and sys.path[0] in ("", "."):
        del sys.path[0]
    run_worker(run_script, sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
