"""What ``dtrain bench`` can compare: one value per method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Method:
    name: str
    description: str
    kind: str = "dtrain"
    """``dtrain`` (bench.worker through dtrain's API) or ``reference`` (plain PyTorch DDP)."""
    strategy: str = "ddp"
    precision: str = "fp32"
    launcher: str = "torchrun"
    """torchrun, spawn, or ``none`` (one process started directly)."""
    single_process: bool = False
    gpu_only: bool = False
    parallel: str | None = None
    """A ``--parallel`` layout (e.g. ``dp_shard=2,tp=2``): the worker runs ``dtrain.init(parallel=...)``."""
    comm: str | None = None
    """A ``--comm`` method of DDP (e.g. ``powersgd:2``): the worker runs ``dtrain.init("ddp", comm=...)``."""
    batch_split: str | None = None
    """``speed``: the worker splits the global batch by each rank's measured speed (``--batch-split speed``)."""


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(name="reference", kind="reference", description="plain PyTorch DDP script started by torchrun (no dtrain)"),
        Method(name="single", strategy="single", launcher="none", single_process=True, description="one process: the scaling baseline"),
        Method(name="dp", strategy="dp", launcher="none", single_process=True, description="nn.DataParallel in one process over the visible GPUs"),
        Method(name="ddp", description="dtrain ddp started by torchrun (torch's elastic agent)"),
        Method(name="ddp+split", batch_split="speed",
               description="dtrain ddp, the global batch split by each rank's measured speed (--batch-split speed)"),
        Method(name="ddp-spawn", launcher="spawn", description="dtrain ddp started by torch.multiprocessing.spawn"),
        Method(name="ddp-bf16", precision="bf16-mixed", description="dtrain ddp with bf16 autocast"),
        Method(name="ddp-fp16", precision="fp16-mixed", gpu_only=True, description="dtrain ddp with fp16 autocast and loss scaling (apex O1)"),
        Method(name="hvd", strategy="hvd", description="Horovod's method: the optimizer all-reduces fused gradients"),
        Method(name="zero1", strategy="zero1", description="ZeRO-1: DDP gradients, optimizer state sharded (ZeroRedundancyOptimizer)"),
        Method(name="fsdp", strategy="fsdp", description="fully sharded: parameters, gradients, optimizer state (fully_shard)"),
        Method(name="pipeline", strategy="pipeline", description="pipeline stages, one per process, 4 micro-batches (1F1B)"),
    )
}

DEFAULT_METHODS = ("reference", "dp", "ddp", "ddp-spawn", "ddp-bf16", "ddp-fp16", "hvd")


def layout_methods(layouts: list[str], nproc: int) -> list[Method]:
    """One method per ``--parallel`` layout, named by the layout; each must fill ``nproc`` processes."""
    from ..parallel import parse

    out: list[Method] = []
    for text in layouts:
        dims = parse(text)
        dims.check_world(nproc)
        if any(m.name == str(dims) for m in out):
            raise ConfigError(f"--parallel {dims} is given twice; list each layout once.")
        out.append(Method(name=str(dims), strategy="auto", parallel=str(dims), description=f"dtrain --parallel {dims}"))
    return out


def comm_methods(comms: list[str], warmup: int) -> list[Method]:
    """One method per ``--comm`` method of DDP, named ``ddp+METHOD`` (``ddp+bf16``: bf16 gradients on
    the wire, not ``ddp-bf16``'s autocast); each starts after the bench's ``warmup`` plain steps."""
    from ..comm import CommSpec

    out: list[Method] = []
    for text in comms:
        spec = CommSpec.parse(text)
        if spec.kind in ("none", "auto"):
            why = "is the ddp method itself: add ddp to --methods" if spec.kind == "none" else \
                "chooses at run time, during its measured warm-up: list the methods to compare (e.g. --comm powersgd:2 --comm localsgd:16)"
            raise ConfigError(f"--comm {text}: {why}.")
        if spec.kind == "powersgd" and warmup < 2:
            raise ConfigError(f"--warmup {warmup} is too short for --comm {spec} (DDP settles its buckets in the first steps); use --warmup 2 or more.")
        name = f"ddp+{spec}"
        if any(m.name == name for m in out):
            raise ConfigError(f"--comm {spec} is given twice; list each method once.")
        out.append(Method(name=name, comm=str(spec), description=f"dtrain ddp, gradients sent as --comm {spec}"))
    return out


def parse_methods(text: str | None, device: str | None = None) -> list[Method]:
    """``a,b,c`` -> Methods; the default set drops GPU-only methods on a machine without CUDA
    (or with ``device`` cpu). The ``single`` baseline is always added (scaling efficiency needs it)."""
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if text:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise ConfigError(f"unknown bench method(s) {', '.join(unknown)}; choose from: {', '.join(METHODS)}.")
        if len(set(names)) != len(names):
            raise ConfigError(f"--methods lists a method twice: {text!r}.")
        gpu = [n for n in names if METHODS[n].gpu_only and not cuda]
        if gpu:
            where = "this bench runs on the CPU (--device cpu)" if torch.cuda.is_available() else "none is visible"
            raise ConfigError(f"method(s) {', '.join(gpu)} need a GPU and {where}; drop them from --methods.")
    else:
        names = [n for n in DEFAULT_METHODS if cuda or not METHODS[n].gpu_only]
    if "single" not in names:
        names.insert(0, "single")
    return [METHODS[n] for n in names]
