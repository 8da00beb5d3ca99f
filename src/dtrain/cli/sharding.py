"""Flags of the sharded (zero1, fsdp, hsdp) and pipeline strategies, turned into strategy options."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError

# flag -> (option name, strategies it applies to)
_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fsdp_wrap": ("wrap", ("fsdp", "hsdp")),
    "fsdp_offload": ("offload", ("fsdp", "hsdp")),
    "fsdp_reduce": ("reduce_dtype", ("fsdp", "hsdp")),
    "hsdp_shard_size": ("shard_size", ("hsdp",)),
    "pipeline_schedule": ("schedule", ("pipeline",)),
    "microbatches": ("microbatches", ("pipeline",)),
    "split_points": ("split_points", ("pipeline",)),
}


def add_sharding_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sharded and pipeline strategies")
    g.add_argument("--fsdp-wrap", default=None, metavar="POLICY",
                   help="fsdp/hsdp units: size:N (submodules of >= N parameters), CLASS[,CLASS] (e.g. Linear), "
                        "or none (default: the task's blocks, else size:1000000)")
    g.add_argument("--fsdp-offload", action="store_true", default=None,
                   help="fsdp/hsdp: keep sharded parameters, gradients and optimizer state in CPU memory (GPU runs)")
    g.add_argument("--fsdp-reduce", default=None, metavar="DTYPE",
                   help="fsdp/hsdp: the dtype gradients are reduce-scattered in: fp32 (default), bf16 or fp16 (half the bytes); "
                        "parameters are gathered in the 16-bit type under bf16-mixed/fp16-mixed")
    g.add_argument("--hsdp-shard-size", type=int, default=None, metavar="N",
                   help="hsdp: ranks each parameter is sharded over (default: the processes of one node)")
    g.add_argument("--pipeline-schedule", default=None, choices=("gpipe", "1f1b"), help="pipeline schedule (default 1f1b)")
    g.add_argument("--microbatches", type=int, default=None, metavar="M", help="pipeline: micro-batches per batch (default 4)")
    g.add_argument("--split-points", default=None, metavar="NAME[,NAME]",
                   help="pipeline: names of the nn.Sequential layers that begin stages 1, 2, ... (default: the task's blocks split evenly, else balanced by parameters)")


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given for ``args.strategy`` (or the ``--parallel`` layout); ConfigError for
    a flag of another strategy."""
    options: dict[str, Any] = {}
    layout = getattr(args, "parallel", None)
    present = _layout_kinds(layout) if layout else {args.strategy}
    for attr, (name, owners) in _FLAGS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not present & set(owners) or (layout and name == "shard_size"):
            flag = "--" + attr.replace("_", "-")
            if layout:
                raise ConfigError(f"{flag} does not apply to --parallel {layout} (fsdp flags need dp_shard, pipeline flags pp; "
                                  "the layout sets the shard size); drop it or change the layout.")
            raise ConfigError(f"{flag} applies to --strategy {' or '.join(owners)}, not {args.strategy!r}; drop it or change the strategy.")
        options[name] = value
    return options


def _layout_kinds(layout: str) -> set[str]:
    """The strategies whose flags a layout takes: fsdp's with dp_shard, pipeline's with pp."""
    from ..parallel import parse

    if layout == "auto":  # any: dtrain.cli.train_auto refuses options for a layout it has not picked yet
        return {"fsdp", "hsdp", "pipeline"}
    dims = parse(layout)
    return ({"fsdp", "hsdp"} if dims.dp_shard > 1 else set()) | ({"pipeline"} if dims.pp > 1 else set())
