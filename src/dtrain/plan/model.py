"""Step time and memory of one layout on one cluster, from a model profile (the phases: ``steps``).
Every simplification is in ``ASSUMPTIONS``, printed with the plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster
from .layouts import Layout
from .profile import ModelProfile
from .steps import fsdp_units, recompute_s, stage_share, step_phases

MIB = 2**20
OPT_STATES = {"sgd": 1, "adam": 2, "adamw": 2, "adadelta": 2}  # fp32 state tensors per parameter (momentum; Adam's moments)
OPT_BYTES_TOUCHED = {"sgd": 20, "adam": 28, "adamw": 28, "adadelta": 28}  # read + written per parameter by a step (memory-bound)

ASSUMPTIONS = (
    "compute: GPU preset at FLOPs / (peak x --mfu), CPU or --device cuda timed here; checkpointing adds a forward",
    "collectives: ring all-reduce, NCCL's tree where cheaper, hierarchical across nodes; measured links replace these",
    "ddp: 25 MiB buckets all-reduced as backward produces them; bf16 halves the bytes, powersgd/localsgd send less",
    "zero1: ddp's all-reduce, then each parameter broadcast by its owner, all queued (a latency per owner)",
    "fsdp: a unit per block, gathered (16-bit type under bf16-/fp16-mixed) one ahead; gloo reduce-scatters by all-reduce",
    "tp: 4 activation gathers per block each way, not overlapped; pp: torch's 1F1B/GPipe played out, then the dp sync",
    "memory per rank: fp32 state + activations in flight + fsdp's gathered units, all at once (an upper bound)",
    "every --log-every steps: two one-number all-reduces and the breakdown's all-gather, as dtrain train logs",
)


def fsdp_param_bytes(precision: str) -> int:
    """Bytes a parameter FSDP all-gathers: its mixed-precision policy gathers the 16-bit type."""
    return 2 if precision in ("bf16-mixed", "fp16-mixed") else 4


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The run's options that change its cost (``dtrain train``'s flags)."""

    batch: int  # per process, as --batch-size
    precision: str = "fp32"
    optimizer: str = "sgd"
    grad_accum: int = 1
    activation_checkpointing: bool = False
    microbatches: int = 4
    schedule: str = "1f1b"
    bucket_mib: float = 25.0
    param_comm_bytes: int = 4  # per element FSDP all-gathers (``fsdp_param_bytes``)
    grad_comm_bytes: int = 4
    threads_per_proc: int = 1
    data_s_per_sample: float = 0.0
    log_every: int = 20  # --log-every: each log step's collectives, amortised


@dataclass(frozen=True, kw_only=True)
class Prediction:
    layout: Layout
    step_s: float
    samples_per_step: int
    phases_s: dict[str, float]
    comm_s: float  # on the wire per step, hidden or not
    memory: dict[str, float]
    capacity: float
    single_step_s: float
    tokens_per_sample: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def mem_bytes(self) -> float:
        """Everything the device must hold for this rank (what ``fits`` compares)."""
        return sum(self.memory.values())

    @property
    def state_bytes(self) -> float:  # parameters, gradients and optimizer state
        return sum(self.memory.get(k, 0.0) for k in ("params", "grads", "optimizer"))

    @property
    def peak_bytes(self) -> float:
        """What a measured peak reports: a CPU's peak resident set, a GPU allocator's (no CUDA context)."""
        return self.mem_bytes - self.memory.get("fixed", 0.0)

    @property
    def fits(self) -> bool:
        return self.mem_bytes <= self.capacity

    def scaling_efficiency(self, world: int) -> float | None:  # samples/s over world x one device's alone
        single_rate = self.samples_per_step / max(1, self.layout.dims.dp) / self.single_step_s if self.single_step_s > 0 else 0.0
        return self.samples_per_s / (world * single_rate) if single_rate else None

    def as_dict(self, world: int) -> dict[str, Any]:
        ms = {k: round(v * 1e3, 3) for k, v in self.phases_s.items()}
        return {"layout": self.layout.name, "comm": self.layout.comm, "train_args": self.layout.train_args(),
                "step_ms": round(self.step_s * 1e3, 3), "samples_per_s": round(self.samples_per_s, 2),
                "tokens_per_s": round(self.samples_per_s * self.tokens_per_sample, 1) if self.tokens_per_sample else None,
                "scaling_efficiency": None if (eff := self.scaling_efficiency(world)) is None else round(eff, 4),
                "mem_mib_per_rank": round(self.mem_bytes / MIB, 1),
                "peak_mib_per_rank": round(self.peak_bytes / MIB, 1), "state_mib_per_rank": round(self.state_bytes / MIB, 2),
                "mem_headroom_mib": round((self.capacity - self.mem_bytes) / MIB, 1), "fits": self.fits,
                "exposed_comm_ms": ms.get("exposed_comm", 0.0), "comm_ms": round(self.comm_s * 1e3, 3), "phases_ms": ms,
                "memory_mib": {k: round(v / MIB, 2) for k, v in self.memory.items()}, "notes": self.notes}


def compute_rates(prof: ModelProfile, c: Cluster, s: Settings) -> tuple[float, float, float]:
    """(forward s per sample, backward s per sample, optimizer s per parameter) on one device alone."""
    t = prof.timing
    if t is not None and (not c.is_gpu or c.device.profiled):  # measured on the device planned for
        return t.fwd_s / t.batch, t.bwd_s / t.batch, t.opt_s / max(1, prof.params)
    if s.precision == "float8":  # the converted linears at the float8 peak, their casts (plan/float8.py)
        from .float8 import compute_rates as float8_rates

        return (*float8_rates(prof, c, s), OPT_BYTES_TOUCHED.get(s.optimizer, 28) / c.device.mem_bw)
    fwd = prof.fwd_flops / (c.device.flops(s.precision) * c.device.achieved)
    return fwd, fwd * prof.bwd_ratio, OPT_BYTES_TOUCHED.get(s.optimizer, 28) / c.device.mem_bw


def predict(prof: ModelProfile, c: Cluster, layout: Layout, s: Settings) -> Prediction:
    fwd, bwd, opt = compute_rates(prof, c, s)
    phases, comm_s, notes = step_phases(prof, c, layout, s, fwd, bwd, opt)
    single = s.batch * (fwd + bwd + s.data_s_per_sample + recompute_s(prof, c, s, fwd)) + opt * prof.params
    return Prediction(layout=layout, step_s=sum(phases.values()), samples_per_step=s.batch * layout.dims.dp,
                      phases_s=phases, comm_s=comm_s, memory=memory(prof, c, layout, s), capacity=c.device.memory_bytes,
                      single_step_s=single, tokens_per_sample=prof.tokens_per_sample, notes=notes)


def memory(prof: ModelProfile, c: Cluster, layout: Layout, s: Settings) -> dict[str, float]:
    """Bytes per rank by kind (the largest pipeline stage), at the step's peak."""
    d, (_, p_share, a_share) = layout.dims, stage_share(prof, layout.dims.pp)
    params_rank, shard = prof.params * p_share / d.tp, d.dp_shard
    mem = {"params": 4 * params_rank / shard, "grads": 4 * params_rank / shard,
           "optimizer": 4 * OPT_STATES.get(s.optimizer, 2) * params_rank / (d.dp if layout.zero1 else shard)}
    micro, in_flight = s.batch / max(1, s.grad_accum), 1
    if d.pp > 1:
        micro = s.batch / s.microbatches
        in_flight = s.microbatches if s.schedule == "gpipe" else min(d.pp, s.microbatches)
    act = prof.act_bytes * a_share
    if s.activation_checkpointing and prof.blocks:
        blocks = prof.blocks[: math.ceil(len(prof.blocks) / d.pp)]
        act = act - sum(b.act_bytes for b in blocks) + (sum(b.out_bytes for b in blocks) + max(b.act_bytes for b in blocks))
    mem["activations"] = act * micro * in_flight / d.tp
    if shard > 1:  # the unit being used and the one prefetched, whole
        mem["gathered"] = 2 * max(g for g, _, _ in fsdp_units(prof, s)) / d.tp
    if layout.comm.startswith("powersgd"):  # error feedback: one more copy of the gradient (torch's PowerSGD state)
        mem["comm_state"] = 4 * params_rank
    # the step's own allocations at its peak: on a GPU the gradient of the model's output (fp32, alive with
    # every activation as backward starts); on CPU the plain step's measured peak beyond what is modelled
    m = prof.machinery
    if c.is_gpu and prof.out_bytes:
        mem["transient"] = prof.out_bytes * micro
    elif not c.is_gpu and m is not None and "plain_peak" in m.rss:
        modelled = 4 * prof.params * (1 + OPT_STATES.get(s.optimizer, 2)) + prof.act_bytes * s.batch
        mem["transient"] = max(0.0, m.rss["plain_peak"] - modelled)
    mem["fixed"] = c.device.fixed_bytes
    if m is not None and not c.is_gpu:
        mem["baseline"] = m.rss.get("baseline", 0.0)
    return mem
