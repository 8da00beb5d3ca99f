"""`dtrain dry-run`: check a configuration for a large world before booking it, by running one of
its ranks for real on this machine's device (`dtrain train`'s own program on a meta-built model,
so only its own shard is allocated), with torch's fake process group for the others.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import ConfigError, DtrainError, first_line
from ..tasks import load_task
from ..world.device import pick_device
from .config import DryRunConfig
from .fake import fake_group, world_of
from .rank import RankRun, run_rank
from .report import lines, result

__all__ = ["DryRunConfig", "RankRun", "dry_run", "lines", "run_rank"]


def dry_run(cfg: DryRunConfig, *, with_prediction: bool = True) -> dict[str, Any]:
    """Run rank ``cfg.rank`` of ``cfg.world_size`` here; the record (``report.result``). A
    configuration that cannot run raises one ConfigError line naming the cause."""
    t0 = time.perf_counter()
    device = pick_device(cfg.runtime.device, 0)
    if device.type == "cuda" and device.index is None:  # --device cuda: this machine's current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    world = world_of(cfg.rank, cfg.world_size, cfg.local_size, device)
    with fake_group(world):
        try:
            run = run_rank(cfg, world, task=task)
        except DtrainError:
            raise
        except torch.OutOfMemoryError as exc:
            raise ConfigError(f"rank {cfg.rank} of {cfg.world_size} ran out of memory on {device} "
                              f"({first_line(exc, 300)}); shard more (dp_shard, tp), lower --batch-size, or add "
                              "--activation-checkpointing.") from None
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
            raise ConfigError(f"rank {cfg.rank} of {cfg.world_size} cannot run this configuration: "
                              f"{type(exc).__name__}: {first_line(exc, 300)}; change the layout or the model's shape.") from None
    return result(cfg, task, run, device, time.perf_counter() - t0, with_prediction=with_prediction)
