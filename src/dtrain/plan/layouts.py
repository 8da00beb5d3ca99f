"""The layouts a plan compares: each a strategy name or ``--parallel`` string with a ``--comm`` method."""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.dims import ParallelDims

COMMS = ("none", "bf16", "powersgd:2", "localsgd:16")
"""Default ``--comm`` methods compared on ddp (the only strategy that takes them); fp16 costs as bf16."""


@dataclass(frozen=True)
class Layout:
    name: str  # as `dtrain train` takes it: ``ddp``, ``zero1``, ``fsdp``, ``hsdp``, ``single`` or ``dp_shard=4,tp=2``
    dims: ParallelDims
    zero1: bool = False
    comm: str = "none"

    @property
    def is_strategy(self) -> bool:
        return "=" not in self.name

    def train_args(self) -> list[str]:
        flags = ["--strategy", self.name] if self.is_strategy else ["--parallel", self.name]
        return flags + (["--comm", self.comm] if self.comm != "none" else [])

    def label(self) -> str:
        return self.name if self.comm == "none" else f"{self.name} --comm {self.comm}"


NAMED = ("ddp", "zero1", "fsdp", "hsdp")  # compared by name, each at its registry preset


def named(name: str, world: int, procs_per_node: int, comms: tuple[str, ...] = ("none",)) -> list[Layout]:
    """The strategy ``name`` at its preset, once per comm method where it takes ``--comm`` (ddp)."""
    from .. import strategies

    dims = strategies.preset(name, world, procs_per_node)
    if not strategies.declared(name).supports_comm:
        comms = ("none",)
    return [Layout(name, dims, comm=c, zero1=name == "zero1") for c in comms]


def candidates(world: int, procs_per_node: int, nodes: int, *, blocks: int, tp_ok: bool, pp_ok: bool,
               comms: tuple[str, ...] = COMMS) -> list[Layout]:
    """Every layout (x comm method) that `dtrain train` can run on ``world`` processes."""
    if world == 1:
        return [Layout("single", ParallelDims())]
    out = named("ddp", world, procs_per_node, comms) + named("zero1", world, procs_per_node) + named("fsdp", world, procs_per_node)
    if nodes > 1 and procs_per_node > 1:
        out += named("hsdp", world, procs_per_node)
    for tp in (2, 4, 8):
        if tp_ok and tp <= procs_per_node and procs_per_node % tp == 0 and world % tp == 0:
            out += [Layout(str(dims), dims) for dims in _with_dp(world // tp, tp=tp)]
    for pp in (2, 4, 8):
        if pp_ok and blocks >= pp and world % pp == 0:
            out += [Layout(str(dims), dims) for dims in _with_dp(world // pp, pp=pp)]
    return out


def _with_dp(dp: int, **other: int) -> list[ParallelDims]:
    return [ParallelDims(**other)] if dp == 1 else [ParallelDims(dp_shard=dp, **other), ParallelDims(dp_replicate=dp, **other)]
