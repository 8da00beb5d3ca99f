"""One step of a layout, phase by phase (seconds): the collectives each layout issues, what of
them backward hides, the pipeline's fill and drain. ``model.predict`` adds memory around it.
"""

from __future__ import annotations

import math

from ..comm.spec import CommSpec
from . import costs
from .cluster import Cluster
from .costs import Group, group_of
from .float8 import gather_bytes
from .layouts import Layout
from .profile import ModelProfile


def ddp_sync(nbytes: float, ratio: float, window: float, group: Group, c: Cluster, bucket: float) -> tuple[float, float]:
    """(wire seconds, exposed seconds) of DDP's bucketed all-reduce of ``nbytes`` of gradients
    (sent as ``ratio`` x the bytes) during a backward of ``window`` seconds: each bucket is
    all-reduced once backward has produced it (gradients produced evenly by bytes), one after another."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0, 0.0
    free = wire = 0.0
    for i in range(max(1, math.ceil(nbytes / bucket))):
        size = min(bucket, nbytes - i * bucket)
        t = costs.allreduce(size * ratio, group, c)
        free = max(free, window * min(1.0, (i * bucket + size) / nbytes)) + t
        wire += t
    return wire, max(0.0, free - window)


def pipelined(items: list[tuple[float, float, float]], ahead: bool) -> tuple[float, float, float]:
    """(elapsed, wire, the link's idle time at the end) of units each needing a gather, then
    compute, then a scatter (seconds; either may be 0) on one link in issue order. ``ahead``: the
    next unit's gather is issued as the current one's compute starts (FSDP's prefetch), else once it ends."""
    if not items:
        return 0.0, 0.0, 0.0
    free = last = items[0][0]
    gather_end, comp_end, wire = free, 0.0, sum(g + s for g, _, s in items)
    for i, (_, comp, scatter) in enumerate(items):
        start = max(comp_end, gather_end)
        comp_end = start + comp
        if i + 1 < len(items):
            gather_end = max(free, start if ahead else comp_end) + items[i + 1][0]
            if items[i + 1][0] > 0:
                free = last = gather_end
        if scatter > 0:
            free = last = max(free, comp_end) + scatter
    end = max(comp_end, free)
    return end, wire, end - last


def fsdp_units(prof: ModelProfile) -> list[tuple[float, float]]:
    """(parameters, forward-FLOP share) of each FSDP unit in forward order: the rest of the
    model (the root: embeddings, head) first, then the blocks."""
    rest_p = prof.params - sum(b.params for b in prof.blocks)
    rest_f = prof.fwd_flops - sum(b.fwd_flops for b in prof.blocks)
    units = [(max(0, rest_p), max(0.0, rest_f))] + [(b.params, b.fwd_flops) for b in prof.blocks]
    total_f = prof.fwd_flops or 1.0
    return [(p, f / total_f) for p, f in units if p > 0 or f > 0]


def fsdp_step(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd_t: float, bwd_t: float,
              g_shard: Group, g_rep: Group) -> tuple[float, float, float]:
    """(forward elapsed, backward elapsed, wire) under fsdp/hsdp: each unit gathered in forward and
    again in backward (prefetched one ahead), its gradient reduce-scattered (hsdp: then all-reduced
    between the replicas), on one link in issue order."""
    tp, units = layout.dims.tp, fsdp_units(prof)
    ag = [costs.gather(x / tp, g_shard, c) for x in gather_bytes(prof, s)]  # float8 weights in 1 byte
    rs = [costs.gather(x, g_shard, c, reduce=True) + costs.allreduce(x / g_shard.size, g_rep, c)
          for x in (s.grad_comm_bytes * p / tp for p, _ in units)]
    f_el, f_wire, _ = pipelined([(a, fwd_t * f, 0.0) for a, (_, f) in zip(ag, units)], c.is_gpu)
    b_el, b_wire, _ = pipelined([(a, bwd_t * f, r) for a, (_, f), r in zip(ag, units, rs)][::-1], True)
    return f_el, b_el, f_wire + b_wire


def comm_cost(prof: ModelProfile, c: Cluster, layout: Layout, s, bwd_window: float, nbytes: float,
              group: Group, rate: float) -> tuple[float, float, str | None]:
    """(wire s, exposed s, note) of ddp's gradient sync under ``--comm``."""
    spec = CommSpec.parse(layout.comm)
    if spec.kind in ("none", "fp16", "bf16"):
        wire, exposed = ddp_sync(nbytes, 1.0 if spec.kind == "none" else 0.5, bwd_window, group, c, s.bucket_mib * 2**20)
        return wire, exposed, None
    if spec.kind == "powersgd":
        from .model import powersgd_elements

        r = spec.rank
        sent = powersgd_elements(prof, r) * 4 / layout.dims.tp
        # three all-reduces (P, Q, the uncompressed rest) after backward: one bucket, nothing overlaps
        wire = costs.allreduce(sent, group, c) + 2 * costs.allreduce(4, group, c)
        flops = sum(4 * m * n * r for m, n in prof.matrices if m * n >= 2 * r * (m + n)) / layout.dims.tp
        compute = 0.0 if prof.machinery is not None else flops / rate  # measured: in the profile's backward
        return wire, wire + compute, f"powersgd:{r}: {sent / max(1.0, nbytes):.3f} of the gradient bytes"
    if spec.kind == "localsgd":
        m, period = prof.machinery, spec.period
        wire = costs.allreduce(nbytes, group, c) / period
        average = (m.average_s or 0.0) / period if m is not None else 0.0
        return wire, wire + average, f"localsgd:{period}: parameters averaged every {period} steps (amortised)"
    raise ValueError(f"unknown comm {layout.comm!r}")


def pipeline_step(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd_t: float, bwd_t: float, params_rank: float,
                  groups: tuple[Group, Group, Group]) -> tuple[dict[str, float], float, float]:
    """(schedule phases, wire s, exposed s) of pp x dp: torch's schedule played out
    (``pipeline_sim``), then the dp sync, not overlapped."""
    from .pipeline_sim import makespan

    d, m = layout.dims, s.microbatches
    g_pp, g_rep, g_shard = groups
    hop = costs.p2p(s.batch / m * prof.boundary_bytes / d.tp, g_pp, c)
    bubble = (d.pp - 1) * (fwd_t + bwd_t) / m
    span = makespan(d.pp, m, fwd_t / m, bwd_t / m, hop, s.schedule, costs.p2p(1, g_pp, c))
    phases = {"bubble": bubble, "p2p": max(0.0, span - fwd_t - bwd_t - bubble)}
    grad_bytes = s.grad_comm_bytes * params_rank
    if d.dp_shard > 1:
        sync = costs.gather(s.param_comm_bytes * params_rank, g_shard, c) + costs.gather(grad_bytes, g_shard, c, reduce=True)
    else:
        sync = costs.allreduce(grad_bytes, g_rep, c)
    return phases, 2 * m * (d.pp - 1) * hop / d.pp + sync, sync


def measured_extra(prof: ModelProfile, layout: Layout) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds the layout's machinery adds to a step, as the
    profile measured it on this CPU (``machinery``); 0 unmeasured."""
    m = prof.machinery
    if m is None:
        return 0.0, 0.0, 0.0
    from .machinery import kinds_of

    extras = [m.extra(kind) for kind in kinds_of(layout)]
    return (sum(e.forward for e in extras), sum(e.backward for e in extras), sum(e.optimizer for e in extras))


def pipeline_compute(prof: ModelProfile, layout: Layout, s, f_share: float) -> tuple[float, float] | None:
    """(forward, backward) seconds of the busiest stage's micro-batches from the profile: one
    micro-batch's own time (small batches run less efficiently) x the stage's share, plus the
    schedule's measured work per micro-batch (in forward); None unmeasured."""
    m = prof.machinery
    if m is None or "micro" not in m.steps or "pp" not in m.steps:
        return None
    mb, n = m.steps["micro"], s.microbatches
    schedule = max(0.0, m.steps["pp"].forward - m.microbatches * (mb.forward + mb.backward)) / m.microbatches
    return n * (mb.forward * f_share / layout.dims.tp + schedule), n * mb.backward * f_share / layout.dims.tp


def step_phases(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd: float, bwd: float,
                opt: float) -> tuple[dict[str, float], float, list[str]]:
    """Phase -> seconds of one optimizer step on the busiest rank; wire seconds; notes."""
    from .model import recompute_s, stage_share

    d, ppn, b = layout.dims, c.procs_per_node, s.batch
    g_tp = group_of(d.tp, 1, ppn)
    g_shard = group_of(d.dp_shard, d.tp, ppn)
    g_rep = group_of(d.dp_replicate, d.tp * d.dp_shard, ppn)
    g_pp = group_of(d.pp, d.tp * d.dp, ppn)
    f_share, p_share, _ = stage_share(prof, d.pp)
    params_rank = prof.params * p_share / d.tp
    fwd_t, bwd_t = b * fwd * f_share / d.tp, b * bwd * f_share / d.tp
    if d.pp > 1 and (piped := pipeline_compute(prof, layout, s, f_share)) is not None:
        fwd_t, bwd_t = piped
    bwd_t += b * recompute_s(prof, c, s, fwd) * f_share / d.tp
    extra_f, extra_b, extra_o = measured_extra(prof, layout)
    fwd_t, bwd_t = fwd_t + extra_f, bwd_t + extra_b
    phases = {"data": b * s.data_s_per_sample, "forward": fwd_t, "backward": bwd_t}
    opt_t = opt * params_rank / (d.dp if layout.zero1 else d.dp_shard) + extra_o
    notes: list[str] = []
    wire = exposed = 0.0
    if d.pp > 1:
        pp_phases, wire, exposed = pipeline_step(prof, c, layout, s, fwd_t, bwd_t, params_rank, (g_pp, g_rep, g_shard))
        phases.update(pp_phases)
        notes.append(f"pipeline bubble {(d.pp - 1) / (s.microbatches + d.pp - 1):.0%} of the schedule (m={s.microbatches}, p={d.pp})")
    elif d.dp_shard > 1:
        f_el, b_el, wire = fsdp_step(prof, c, layout, s, fwd_t, bwd_t, g_shard, g_rep)
        exposed = (f_el - fwd_t) + (b_el - bwd_t)
    elif d.dp_replicate > 1:
        window = bwd_t / max(1, s.grad_accum)  # only the last micro-batch's backward overlaps
        rate = prof.fwd_flops / fwd if fwd > 0 else 1e12
        wire, exposed, note = comm_cost(prof, c, layout, s, window, s.grad_comm_bytes * params_rank, g_rep, rate)
        notes += [note] if note else []
    more = serial_comm(prof, c, layout, s, params_rank, g_rep, g_tp)
    phases["exposed_comm"] = exposed + more
    phases["log"] = log_step(c, s) / max(1, s.log_every)
    phases["optimizer"] = opt_t
    return phases, wire + more, notes


def log_step(c: Cluster, s) -> float:
    """Seconds of the collectives a log step adds (every ``s.log_every`` steps, on every rank):
    the loss's mean and the preemption check (an all-reduce of one number each), then the
    breakdown's all-gather of each rank's medians and p90s."""
    from ..metrics.breakdown import STAT_KEYS

    world = Group(c.nodes, c.procs_per_node)
    per_rank = (2 * len(STAT_KEYS) + 2) * 8  # float64: medians, p90s, the step count, the peak memory
    return 2 * costs.allreduce(4, world, c) + costs.gather(per_rank * world.size, world, c)


def serial_comm(prof: ModelProfile, c: Cluster, layout: Layout, s, params_rank: float, g_rep: Group, g_tp: Group) -> float:
    """Seconds of the collectives nothing overlaps: zero1's parameter broadcasts, TP's activations."""
    out = 0.0
    if layout.zero1:
        # torch's ZeroRedundancyOptimizer broadcasts each parameter from the rank that stepped it,
        # all issued before any is waited for: a latency per sending rank, not per tensor
        out += costs.broadcast(4 * params_rank, g_rep, c, messages=min(prof.tensors, g_rep.size))
    if layout.dims.tp > 1:
        per = costs.gather(s.batch * prof.boundary_bytes, g_tp, c)
        out += 8 * len(prof.blocks) * per + 2 * costs.gather(s.batch * prof.out_bytes, g_tp, c)
    return out
