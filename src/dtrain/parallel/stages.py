"""One pipeline as a rank sees it: which stage it runs, the ranks of the other stages, and the
two passes through the stages: the training step (a ``torch.distributed.pipelining`` schedule)
and evaluation's forward-only pass. Built by ``apply.apply_pp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..precision import Precision

if TYPE_CHECKING:
    from ..comm.collectives import Collectives
    from ..world import World
    from .pipeline import PipelineConfig


@dataclass(frozen=True)
class Stages:
    """This rank's place in its pipeline."""

    index: int
    """The stage this rank runs (0: reads the inputs; ``count - 1``: computes the loss)."""
    ranks: tuple[int, ...]
    """The global rank of each stage of this rank's pipeline."""
    group: Any = None
    """The process group of ``ranks`` (None: the default group, i.e. the whole world)."""

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @classmethod
    def of_world(cls, world: World) -> Stages:
        """One pipeline over every rank (``pp`` = the world size): stage = rank."""
        return cls(index=world.rank, ranks=tuple(range(world.size)))

    @classmethod
    def of_mesh(cls, pp_mesh: Any) -> Stages:
        """The pipeline along a 1-D ``pp`` sub-mesh (ranks that differ only in their stage)."""
        group = pp_mesh.get_group()
        ranks = tuple(dist.get_global_rank(group, i) for i in range(pp_mesh.size()))
        return cls(index=pp_mesh.get_local_rank(), ranks=ranks, group=group)


def check_batch(precision: Precision, size: int, microbatches: int, *, accum: tuple[int, int] | None = None) -> None:
    """What a pipeline step refuses: fp16's loss scaling, and a batch of ``size`` that its
    micro-batches do not divide (``accum``: the --batch-size and --grad-accum that cut it, named)."""
    if precision.scale_loss:
        raise ConfigError("pipeline does not support fp16-mixed (loss scaling); use --precision bf16-mixed or fp32.")
    if size % microbatches:
        batch, k = accum or (size, 1)
        per = f" (--batch-size {batch} over --grad-accum {k})" if k > 1 else ""
        raise ConfigError(f"pipeline: a batch of {size} samples{per} cannot be split into {microbatches} micro-batches; "
                          f"use a batch size that is a multiple of {microbatches * k}.")


class Pipe:
    """The passes of one stage module through its pipeline."""

    def __init__(self, stages: Stages, config: PipelineConfig, device: torch.device) -> None:
        self.stages, self.config, self.device = stages, config, device
        self._schedules: dict[tuple[int, int], Any] = {}
        self._loss_fn: Callable | None = None

    def forward_backward(self, module: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """Forward and backward of one (micro-)batch through every stage; the mean loss, on every
        rank of this pipeline. Collective: call on every rank, the same batch within a pipeline."""
        check_batch(precision, len(inputs), self.config.microbatches)
        accum = accumulation_steps
        self._loss_fn = loss_fn  # read by the schedule's loss function (built once per window size)
        schedule = self._schedule(module, accum)
        losses: list[torch.Tensor] = []
        with precision.autocast(), collectives.labelled(f"pipeline step ({self.config.schedule})", inputs):
            if self.stages.is_first:
                schedule.step(inputs)
            elif self.stages.is_last:
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()
        # Each micro-batch loss was divided by (micro-batches x accumulation window): undo it.
        mean = torch.stack([loss.detach().float() for loss in losses]).sum() * accum if losses else torch.zeros((), device=inputs.device)
        with collectives.labelled("pipeline loss (broadcast from the last stage)", mean):
            dist.broadcast(mean, src=self.stages.ranks[-1], group=self.stages.group)
        return mean

    def _schedule(self, module: nn.Module, accum: int) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (id(module), accum)
        if key not in self._schedules:
            n = self.config.microbatches
            stage = PipelineStage(module, self.stages.index, self.stages.count, self.device, group=self.stages.group)
            cls = ScheduleGPipe if self.config.schedule == "gpipe" else Schedule1F1B

            def scaled(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                # torch's scale_grads divides *all* .grad by the micro-batch count after each
                # step, which would shrink gradients accumulated over earlier steps; scale the
                # loss instead so accumulation windows stay exact.
                return self._loss_fn(out, y) / (n * accum)

            self._schedules[key] = cls(stage, n_microbatches=n, loss_fn=scaled, scale_grads=False)
        return self._schedules[key]

    @torch.no_grad()
    def forward_only(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The whole model's output for ``inputs``, on the last stage (None on the others):
        each stage receives its input from the previous one and sends its output on. For
        evaluation, whatever the batch size. Collective: call on every rank of the pipeline."""
        stages = self.stages
        x = inputs if stages.is_first else _recv_tensor(stages.ranks[stages.index - 1], inputs.device)
        out = module(x)
        if not stages.is_last:
            _send_tensor(out, stages.ranks[stages.index + 1])
            return None
        return out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_HEADER = 8  # dtype code, number of dims, up to 6 sizes


def _send_tensor(t: torch.Tensor, dst: int) -> None:
    """Send ``t`` (shape and dtype first) to global rank ``dst``."""
    if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
        raise ConfigError(f"pipeline: a stage output of dtype {t.dtype} and {t.dim()} dims cannot be passed on; use a float tensor of at most {_HEADER - 2} dims.")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header.to(t.device), dst)
    dist.send(t.contiguous(), dst)


def _recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    """Receive what ``_send_tensor`` sent from global rank ``src``."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    header = header.tolist()
    t = torch.empty(header[2:2 + header[1]], dtype=_DTYPES[header[0]], device=device)
    dist.recv(t, src)
    return t
