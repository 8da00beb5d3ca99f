"""The machines a plan is for: a device and the links inside a node and between nodes (bytes/s one
way, seconds a message), from a preset, flags, a ``--cluster`` file, or measured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import ConfigError
from . import inputs
from .costs import Figure, Links

GB = 1e9
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or one CPU process's share of a machine)."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by precision (``fp32``, ``bf16-mixed``, ``fp16-mixed``): the data sheet's."""
    memory_bytes: float
    mem_bw: float  # memory bandwidth (bytes/s): the optimizer step is bound by it
    achieved: float = 0.4  # fraction of the peak a training step achieves (MFU); a profile measures it instead
    fixed_bytes: float = 0.0  # memory taken before the model: CUDA context, allocator reserve, the framework
    profiled: bool = False  # this machine's GPU (``--device cuda``): its step is timed instead of FLOPs x ``achieved``
    bf16: bool = True
    """Has bf16 arithmetic (Ampere and newer), for ``--precision auto``."""

    def flops(self, precision: str) -> float:
        return self.peak_flops.get(precision) or self.peak_flops["fp32"]


def _gpu(name: str, bf16_tflops: float, tf32_tflops: float, mem_gb: float, bw_tbs: float, bf16: bool = True) -> Device:
    # fp32 on tensor cores runs in TF32 (as dtrain's flops table counts); 1.5 GiB: the CUDA context and slack
    return Device(name=name, peak_flops={"fp32": tf32_tflops * 1e12, "bf16-mixed": bf16_tflops * 1e12,
                                          "fp16-mixed": bf16_tflops * 1e12},
                  memory_bytes=mem_gb * GB, mem_bw=bw_tbs * 1e12, fixed_bytes=1.5 * GIB, bf16=bf16)


DEVICES: dict[str, Device] = {
    "h100": _gpu("H100 SXM", 989.0, 494.0, 80.0, 3.35),
    "h200": _gpu("H200 SXM", 989.0, 494.0, 141.0, 4.8),
    "a100": _gpu("A100 SXM 80GB", 312.0, 156.0, 80.0, 2.04),
    "a100-40": _gpu("A100 SXM 40GB", 312.0, 156.0, 40.0, 1.56),
    "v100": _gpu("V100 SXM2 32GB", 125.0, 15.7, 32.0, 0.9, bf16=False),  # fp16 tensor cores, no bf16
    "p100": _gpu("P100 SXM2 16GB", 21.2, 10.6, 16.0, 0.732, bf16=False),  # no tensor cores: fp16 = 2x fp32
}
"""Data-sheet figures (dense, no sparsity)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``procs_per_node`` processes, one device each, and their links."""

    nodes: int = 1
    procs_per_node: int = 1
    device: Device
    intra_bw: float = 100 * GB  # between two processes of one node (NVLink, shared memory), bytes/s one way per process
    intra_lat: float = 5e-6
    inter_bw: float = 12.5 * GB  # what one node sends to the others, bytes/s (all its NICs)
    inter_lat: float = 10e-6
    tree: bool = True  # all-reduces may use a tree where cheaper (NCCL does); gloo rings only
    source: dict[str, str] = field(default_factory=dict)  # where each figure came from (preset, flag, file, measured)
    links: dict[str, Links] = field(default_factory=dict)
    """Collectives measured ``intra`` (a node's processes) and ``inter`` (nodes), replacing the figures above."""

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node", "intra_bw", "inter_bw"):
            value, bw = getattr(self, name), name.endswith("_bw")
            if not (value > 0 if bw else value >= 1):
                raise ConfigError(f"cluster {name} must be {'> 0 bytes/s' if bw else '>= 1'}, got {value}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def backend(self) -> str:
        return "nccl" if self.is_gpu else "gloo"

    @property
    def is_gpu(self) -> bool:
        return not self.device.name.startswith("cpu")

    def figure(self, kind: str, crossing: bool, sharing: int = 1) -> Figure:
        """Collective ``kind``'s figure inside a node or between nodes (``crossing``), ``sharing`` the NICs."""
        measured = self.links.get("inter" if crossing else "intra")
        if measured is not None and kind in measured.figures:
            f = measured.figures[kind]
        else:
            f = Figure(self.inter_lat, self.inter_bw) if crossing else Figure(self.intra_lat, self.intra_bw)
        return f.shared(sharing) if crossing and sharing > 1 else f

    def describe(self) -> dict[str, Any]:
        d = self.device
        return {"nodes": self.nodes, "procs_per_node": self.procs_per_node, "device": d.name,
                "peak_tflops": {k: round(v / 1e12, 3) for k, v in d.peak_flops.items()},
                "achieved_fraction": d.achieved, "memory_gib": round(d.memory_bytes / GIB, 2),
                "intra_gbytes_per_s": self.intra_bw / GB, "intra_latency_us": self.intra_lat * 1e6,
                "inter_gbytes_per_s": self.inter_bw / GB, "inter_latency_us": self.inter_lat * 1e6,
                "tree_allreduce": self.tree, "source": dict(self.source),
                "links_measured": {k: v.describe() for k, v in self.links.items()}}


# Links of known machines (one way): H100/H200 NVLink 4, 450 GB/s a GPU, 8 x 400 Gbit/s InfiniBand a node;
# A100 NVLink 3, 300 GB/s, 8 x 200 Gbit/s; V100 150 GB/s, 4 x 100 Gbit/s; P100 80 GB/s, 100 Gbit/s.
LINKS: dict[str, dict[str, float]] = {
    key: {"intra_bw": intra * GB, "inter_bw": inter * GB, "intra_lat": 5e-6, "inter_lat": 10e-6}
    for keys, intra, inter in ((("h100", "h200"), 450, 8 * 50), (("a100", "a100-40"), 300, 8 * 25), (("v100",), 150, 4 * 12.5),
                               (("p100",), 80, 12.5)) for key in keys}


def cpu_device(achieved_flops: float | None = None, memory_bytes: float | None = None) -> Device:
    """This machine's CPU as one process sees it: the rate a profile achieved is its peak, at fraction 1."""
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory_bytes = 16 * GIB
    return Device(name="cpu (measured)", peak_flops=dict.fromkeys(("fp32", "bf16-mixed", "fp16-mixed"), achieved_flops or 1e10),
                  memory_bytes=memory_bytes, mem_bw=10 * GB, achieved=1.0)


def preset_for(gpu_name: str, memory_bytes: float) -> str | None:
    """The ``DEVICES`` key of a GPU's name ('NVIDIA H100 80GB HBM3' -> 'h100'; an A100 under 60 GiB: 'a100-40')."""
    lowered = gpu_name.lower().replace(" ", "").replace("-", "")
    key = next((k for k in ("h200", "h100", "a100", "v100", "p100") if k in lowered), None)
    return "a100-40" if key == "a100" and memory_bytes < 60 * GIB else key


def local_gpu() -> tuple[Device, str | None]:
    """``--device cuda``: this machine's first GPU, to be profiled, as the preset its name matches (and its
    key; None: no preset, its peak is then what the profile achieves)."""
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible here; name the GPU kind to plan for instead "
                          f"(--device {', '.join(DEVICES)}), or run the plan where the GPU is.")
    props = torch.cuda.get_device_properties(0)
    mem, key = float(props.total_memory), preset_for(props.name, float(props.total_memory))
    base = DEVICES[key] if key else replace(_gpu(props.name, 0.0, 0.0, 0.0, 1.0, bf16=props.major >= 8), achieved=1.0)
    return replace(base, name=f"{props.name} (this GPU, profiled)", memory_bytes=mem, profiled=True), key


def device_named(kind: str) -> Device:
    key = kind.lower()
    if key == "cpu":
        return cpu_device()
    if key not in DEVICES:
        raise ConfigError(f"unknown --device {kind!r}; choose one of: {', '.join([*DEVICES, 'cuda', 'cpu'])}, "
                          "or give --peak-tflops and --mem-gib.")
    return DEVICES[key]


def load_file(path: str) -> dict[str, Any]:
    """A ``--cluster`` file (JSON, or YAML with PyYAML): keys as ``inputs.SETTINGS``, each checked."""
    what, fix = f"--cluster {path!r}", 'give a JSON (or YAML) file such as {"device": "h100", "nodes": 4}'
    data = inputs.parse(what, inputs.read_text(what, path, fix), fix, yaml=path.endswith((".yaml", ".yml")))
    if not isinstance(data, dict):
        raise ConfigError(f"{what} holds {inputs.shown(data)}, not one object of keys; {fix}.")
    return inputs.cluster_settings(data, what)


def build(settings: dict[str, Any]) -> Cluster:
    """A Cluster from ``inputs.SETTINGS`` keys (None skipped); a preset's links fill what is not given."""
    s = {k: v for k, v in settings.items() if v is not None}
    kind = str(s.get("device", "cpu")).lower()
    if kind == "cuda":
        if "achieved_fraction" in s:
            raise ConfigError(f"--mfu {s['achieved_fraction']} with --device cuda: the plan measures this GPU's step; "
                              "leave out --mfu, or name the GPU kind (e.g. --device h100) to plan from FLOPs x --mfu.")
        device, preset = local_gpu()
        source = {"device": "this GPU, profiled" + (f" (data sheet and links: preset {preset})" if preset else "")}
        kind = preset or "cuda"
    else:
        device, source = device_named(kind), {"device": f"preset {kind}" if kind in DEVICES else "cpu"}
    changes: dict[str, Any] = {}
    if "peak_tflops" in s:
        changes["peak_flops"], source["peak_tflops"] = dict.fromkeys(device.peak_flops, float(s["peak_tflops"]) * 1e12), "given"
    changes.update({name: float(s[key]) * unit for key, name, unit in (("memory_gib", "memory_bytes", GIB),
                                                                       ("mem_bw_gbytes_per_s", "mem_bw", GB)) if key in s})
    if "achieved_fraction" in s:
        if not 0 < (frac := float(s["achieved_fraction"])) <= 1:
            raise ConfigError(f"--mfu {frac} must be a fraction of the peak in (0, 1]; e.g. --mfu 0.4.")
        changes["achieved"], source["achieved_fraction"] = frac, "given"
    device = replace(device, **changes)
    # CPU processes talk through gloo over TCP: a few hundred microseconds a message, locally ~1 GB/s
    links = dict(LINKS.get(kind, {"intra_bw": 1 * GB, "inter_bw": 0.125 * GB, "intra_lat": 200e-6, "inter_lat": 250e-6}))
    source["links"] = f"preset {kind}" if kind in LINKS else "defaults (gloo: 1 GB/s, 200 us inside a node; 1 Gbit/s, 250 us between; measure with `dtrain doctor`)"
    for key, name, unit in (("intra_gbit", "intra_bw", 1e9 / 8), ("inter_gbit", "inter_bw", 1e9 / 8),
                            ("intra_latency_us", "intra_lat", 1e-6), ("inter_latency_us", "inter_lat", 1e-6)):
        if key in s:
            links[name] = float(s[key]) * unit
            source.update({name: "given"} if name.endswith("_bw") else {})
    return Cluster(nodes=int(s.get("nodes", 1)), procs_per_node=int(s.get("procs_per_node", 1)), device=device,
                   tree=bool(s.get("tree", kind in LINKS)), source=source, **links)


def with_links(c: Cluster, measured: dict[str, Links]) -> Cluster:
    """``c`` with link measurements (``intra``/``inter``); where each came from in ``source``."""
    if not measured:
        return c
    source = dict(c.source)
    for where, got in measured.items():
        load = "" if got.load is None else f", load {got.load:.1f}"
        source[f"links_{where}"] = f"measured between {got.ranks} {got.between} ({got.backend}{load})"
    return replace(c, links={**c.links, **measured}, source=source)

