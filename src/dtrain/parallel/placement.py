"""Where this rank sits in a layout and what the apply path made of the model there (mesh, stage,
replaced parameters), kept by the strategy for the hooks after setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..world import World
from .dims import ParallelDims
from .stages import Pipe


@dataclass(eq=False)
class Placement:
    """The layout ``dims`` on ``world``, as this rank holds it."""

    dims: ParallelDims
    world: World
    pipe: Pipe | None = None
    """This rank's pipeline (its stage's place and the schedule), when the model was cut into stages."""
    stage_params: set[int] | None = None
    """Ids of the parameters of this rank's stage (None: the whole model is here)."""
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    """id of a parameter the optimizer was built on -> the parameter TP or FSDP put in its place."""
    scores: bool = True
    """Whether this rank's evaluation outputs are counted: under TP only the first rank of each
    TP group's (its peers compute the same outputs, which would count every sample tp times)."""
    param_dtype: torch.dtype | None = None
    """The dtype ``fully_shard`` gathers parameters in and runs forward and backward in (its
    mixed-precision policy): the precision's 16-bit type; None where nothing is sharded or in fp32."""
    float8_linears: int = 0
    """Linears ``apply_float8`` converted (``--precision float8``)."""
    float8_all_gather: bool = False
    """FSDP all-gathers those weights in float8 (tensorwise), their scales computed after each
    optimizer step (``dtrain.parallel.float8.after_step``)."""
    _mesh: Any = None

    @property
    def mesh(self) -> Any:
        """The layout's one ``DeviceMesh``, built when first needed (ddp and pipeline alone need none).
        Collective the first time: every rank asks at the same step."""
        if self._mesh is None:
            self._mesh = self.dims.build_mesh(self.world.device.type, self.world.backend)
        return self._mesh

    def again(self, dims: ParallelDims, world: World) -> Placement:
        """A fresh placement of ``dims`` on ``world`` for another model, sharing this one's mesh
        when the layout is the same (a strategy set up twice builds its process groups once)."""
        same = dims == self.dims and world == self.world
        return Placement(dims, world, _mesh=self._mesh if same else None)

    def __getitem__(self, names: str | tuple[str, ...]) -> Any:
        """``place["tp"]``: the sub-mesh of these dimensions (``mesh[...]``)."""
        return self.mesh[names]

    def group(self, dim: str) -> Any:
        """The process group of this rank's peers along ``dim``: None (the default group) when
        ``dim`` spans the whole world, as the mesh itself would then use it, so no mesh is built."""
        if getattr(self.dims, dim) == self.world.size:
            return None
        return self.mesh.get_group(dim)

    def note_replaced(self, before: dict[str, nn.Parameter], model: nn.Module) -> None:
        """Record which of the ``before`` parameters (by name) the model now holds in another form."""
        after = dict(model.named_parameters())
        self.replaced.update({id(p): after[n] for n, p in before.items() if n in after and after[n] is not p})

    def fit_optimizer(self, optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
        """The optimizer, built on the whole model, as this rank's part needs it: only this stage's
        parameters, pointed at the DTensors TP and FSDP put in place of the ones it was built on."""
        mine = self.stage_params
        if mine is None and not self.replaced:
            return optimizer
        if any(optimizer.state.values()):
            raise ConfigError(f"{name}: the {type(optimizer).__name__} already holds state; build it fresh, "
                              "call ctx.setup, then load a checkpoint.")
        for group in optimizer.param_groups:
            group["params"] = [self.replaced.get(id(p), p) for p in group["params"] if mine is None or id(p) in mine]
        return optimizer
