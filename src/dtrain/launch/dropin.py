"""``dtrain run`` as a drop-in for ``torch.distributed.launch`` (docs/launching.md): the
``--local_rank=N`` argument old scripts parse, and one clear line, not a hang, when a script starts
its own workers or names its own world size in ``init_process_group``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from ..errors import LaunchError
from ..options import launch_link
from ..world.sources import TorchrunEnv

_DECLARES = re.compile(r"""add_argument\(\s*['"](--local[_-]rank)['"]""")


def declared_local_rank_flag(script: str) -> str | None:
    """``--local_rank`` (or ``--local-rank``) when the script's argparse declares it."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            match = _DECLARES.search(f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def script_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--local_rank=N`` in front when the launcher was asked to pass it."""
    flag, local_rank = launch_link().local_rank_arg, TorchrunEnv.local_rank()
    if not flag or local_rank is None:
        return argv
    return [f"{flag}={local_rank}", *argv]


def guard_own_world() -> None:
    """In a worker of a multi-process ``dtrain run``: refuse ``mp.spawn`` and a mismatched
    ``init_process_group(world_size=...)`` with one line that says what to do."""
    size = TorchrunEnv.size()
    if size <= 1:
        return
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def refuse_spawn(name: str, nprocs: int | None) -> None:
        raise LaunchError(
            f"the script starts {nprocs if nprocs is not None else 'its own'} worker processes with "
            f"torch.multiprocessing.{name}, but `dtrain run` already started {size}: the launcher's world "
            f"({size} processes) and the script's disagree; run it as `python SCRIPT` (it spawns its own "
            "workers), or drop the spawn and let dtrain run start the workers (rank from dtrain.init() or $RANK).")

    @functools.wraps(mp.spawn)
    def spawn(fn: Any, args: Any = (), nprocs: int = 1, *a: Any, **kw: Any) -> Any:
        refuse_spawn("spawn", nprocs)

    @functools.wraps(mp.start_processes)
    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *a: Any, **kw: Any) -> Any:
        refuse_spawn("start_processes", nprocs)

    original_init = dist.init_process_group

    @functools.wraps(original_init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
        if asked not in (-1, None) and int(asked) != size:
            raise LaunchError(
                f"the script calls init_process_group(world_size={asked}), but `dtrain run` started {size} "
                f"processes; pass world_size={size} (or leave it out: it comes from $WORLD_SIZE), or run "
                f"`dtrain run -n {asked}`.")
        return original_init(*args, **kwargs)

    mp.spawn, mp.start_processes = spawn, start_processes
    dist.init_process_group = init_process_group
