"""Cutting an ``nn.Sequential`` into pipeline stages (between the model's blocks, at named split
points, or balanced by parameter count), each under the layers' original names.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    schedule: str = "1f1b"
    """``gpipe`` (all forwards, then all backwards: activations of every micro-batch held) or
    ``1f1b`` (one forward, one backward in turn: at most #stages micro-batches in flight)."""
    microbatches: int = 4
    """Micro-batches per batch; the batch size must be a multiple. More: a smaller bubble."""
    split_points: tuple[str, ...] | None = None
    """Names of the ``nn.Sequential`` children that begin stages 1, 2, ... (e.g. ``("3",)``);
    default: the model's blocks split evenly, else stages balanced by parameter count."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}.")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}.")
        if isinstance(self.split_points, str):
            object.__setattr__(self, "split_points", tuple(s.strip() for s in self.split_points.split(",") if s.strip()))


def stage_bounds(model: nn.Sequential, stages: int, split_points: tuple[str, ...] | None) -> list[tuple[int, int]]:
    """[start, end) child indices of each stage."""
    names = [name for name, _ in model.named_children()]
    if len(names) < stages:
        raise ConfigError(f"pipeline: the model has {len(names)} layer(s), fewer than the {stages} stages (one per process); use fewer processes.")
    if split_points is not None:
        if len(split_points) != stages - 1:
            raise ConfigError(f"pipeline: {len(split_points)} split point(s) give {len(split_points) + 1} stages, but there are {stages} processes; give {stages - 1}.")
        unknown = [s for s in split_points if s not in names]
        if unknown:
            raise ConfigError(f"pipeline: split point(s) {', '.join(unknown)} are not layers of the model; its layers are: {', '.join(names)}.")
        starts = [names.index(s) for s in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"pipeline: split points {', '.join(split_points)} must be increasing and after the first layer.")
        edges = [0, *starts, len(names)]
        return list(zip(edges[:-1], edges[1:]))
    sizes = [sum(p.numel() for p in child.parameters()) for child in model.children()]
    total, bounds, start, acc = max(1, sum(sizes)), [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left_layers, left_stages = len(sizes) - i - 1, stages - len(bounds) - 1
        if left_stages and (acc >= total * (len(bounds) + 1) / stages or left_layers == left_stages):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(sizes)))
    return bounds


def block_bounds(model: nn.Sequential, stages: int, blocks: list[nn.Module]) -> list[tuple[int, int]] | None:
    """[start, end) child indices of each stage, the blocks split evenly; None when the blocks are
    not children of ``model``."""
    children = list(model.children())
    index = {id(c): i for i, c in enumerate(children)}
    at = sorted(index[id(b)] for b in blocks if id(b) in index)
    if len(at) != len(blocks) or not at:
        return None
    if len(at) < stages:
        raise ConfigError(f"pipeline: the model has {len(at)} block(s), fewer than the {stages} stages (one per process); "
                          "use fewer processes or a deeper model.")
    starts = [at[len(at) * s // stages] for s in range(1, stages)]
    edges = [0, *starts, len(children)]
    return list(zip(edges[:-1], edges[1:]))


def split_stage(model: nn.Module, index: int, count: int, config: PipelineConfig,
                blocks: list[nn.Module] | None = None) -> nn.Sequential:
    """Stage ``index`` of ``count``: the children of its range, under their original names (so
    state dict keys match the whole model's and checkpoints load on any layout)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline: the model is a {type(model).__name__}, not an nn.Sequential, and dtrain cuts only an nn.Sequential "
            "into stages; write it as nn.Sequential(layer, ...), or train it without stages (e.g. fsdp, or --parallel "
            "dp_shard=N,tp=M; a Hugging Face model, --task hf:PATH, cannot be cut yet)."
        )
    bounds = block_bounds(model, count, blocks) if blocks and config.split_points is None else None
    bounds = bounds or stage_bounds(model, count, config.split_points)
    start, end = bounds[index]
    children = list(model.named_children())
    _check_untied(children, bounds)
    return nn.Sequential(OrderedDict(children[start:end]))


def _check_untied(children: list[tuple[str, nn.Module]], bounds: list[tuple[int, int]]) -> None:
    """A parameter shared by layers of two stages (tied weights) would become two copies
    trained apart; refuse it rather than train something else than the model."""
    owner: dict[int, tuple[int, str]] = {}
    for stage, (start, end) in enumerate(bounds):
        for name, child in children[start:end]:
            for pname, p in child.named_parameters():
                seen = owner.setdefault(id(p), (stage, f"{name}.{pname}"))
                if seen[0] != stage:
                    raise ConfigError(
                        f"pipeline: parameter {seen[1]} (stage {seen[0]}) is shared with {name}.{pname} (stage {stage}); "
                        "tied weights cannot span stages: untie them (task lm: --task-arg tie=false)."
                    )
