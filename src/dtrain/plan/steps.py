"""One step of a layout, phase by phase (seconds): the collectives each layout issues, what of
them backward hides, the pipeline's fill and drain. ``model.predict`` adds memory around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from ..comm.spec import CommSpec
from . import costs
from .cluster import Cluster
from .costs import Group, group_of
from .float8 import gather_bytes
from .layouts import Layout
from .profile import ModelProfile


def ddp_sync(nbytes: float, ratio: float, window: float, group: Group, c: Cluster, bucket: float) -> tuple[float, float]:
    """(wire seconds, exposed seconds) of DDP's bucketed all-reduce of ``nbytes`` of gradients
    (sent as ``ratio`` x the bytes) during a backward of ``window`` seconds: a bucket is
    all-reduced once backward has produced it, one after another; one that finds the link idle
    sends its first bytes at once (``costs.idle_saving``; the first, after the forward)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0, 0.0
    n = max(1, math.ceil(nbytes / bucket))
    cost = lambda x: costs.allreduce(x, group, c)  # noqa: E731
    link, end = costs.LinkClock(), 0.0
    for i in range(n):
        size = min(bucket, nbytes - i * bucket)
        ready = window * min(1.0, (i * bucket + size) / nbytes)
        _, end = link.send(ready, cost(size * ratio), costs.idle_saving(cost, "all_reduce", size * ratio, group, c))
    return link.wire, max(0.0, end - window)


def pipelined(items: list[tuple[float, float, float]], ahead: bool, saves: list[tuple[float, float]] | None = None,
              idle: float = math.inf) -> tuple[float, float, float]:
    """(elapsed, wire, idle at the end) of units each needing a gather, then compute, then a scatter
    (seconds; either may be 0) on one link in issue order. ``ahead``: the next unit's gather is issued
    as the current one's compute starts (FSDP's prefetch; a GPU's host runs ahead), else once it ends.
    ``saves``: per unit, what its gather and its scatter take less after the link sat idle long
    enough (``costs.idle_saving``; after a gap of g seconds, ``min(g, save)``); ``idle``: how long
    it sat idle before the first gather. The last is how long the link sat idle when compute ended."""
    if not items:
        return 0.0, 0.0, idle
    saves = saves or [(0.0, 0.0)] * len(items)
    link = costs.LinkClock.idle_for(idle)
    gather_end, comp_end = link.send(0.0, items[0][0], saves[0][0])[1], 0.0
    for i, (_, comp, scatter) in enumerate(items):
        start = max(comp_end, gather_end)
        comp_end = start + comp
        if i + 1 < len(items):
            gather_end = link.send(start if ahead else comp_end, items[i + 1][0], saves[i + 1][0])[1]
        if scatter:
            link.send(comp_end, scatter, saves[i][1])
    end = max(comp_end, link.free)
    return end, link.wire, end - link.last


def fsdp_units(prof: ModelProfile) -> list[tuple[float, float]]:
    """(parameters, forward-FLOP share) of each FSDP unit in forward order: the rest of the
    model (the root: embeddings, head) first, then the blocks."""
    rest_p = prof.params - sum(b.params for b in prof.blocks)
    rest_f = prof.fwd_flops - sum(b.fwd_flops for b in prof.blocks)
    units = [(max(0, rest_p), max(0.0, rest_f))] + [(b.params, b.fwd_flops) for b in prof.blocks]
    total_f = prof.fwd_flops or 1.0
    return [(p, f / total_f) for p, f in units if p > 0 or f > 0]


def fsdp_step(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd_t: float, bwd_t: float,
              g_shard: Group, g_rep: Group, idle: float = math.inf) -> tuple[float, float, float]:
    """(forward elapsed, backward elapsed, wire) under fsdp/hsdp. ``idle``: how long the link sat
    idle before the forward's first gather (the last step's optimizer and data): a gather or
    scatter that finds it idle sends its first bytes at once (``costs.idle_saving``)."""
    tp = layout.dims.tp
    units = fsdp_units(prof)

    def all_gather(x: float) -> float:
        return costs.gather(x, g_shard, c)

    def reduce_scatter(x: float) -> float:
        return costs.gather(x, g_shard, c, reduce=True)

    ag_b = [x / tp for x in gather_bytes(prof, s)]  # float8 weights in 1 byte
    rs_b = [s.grad_comm_bytes * p / tp for p, _ in units]
    ag = [all_gather(x) for x in ag_b]
    rs = [reduce_scatter(x) + costs.allreduce(x / g_shard.size, g_rep, c) for x in rs_b]
    ag_save = [costs.idle_saving(all_gather, "all_gather", x, g_shard, c) for x in ag_b]
    rs_save = [costs.idle_saving(reduce_scatter, costs.gather_kind(g_shard, c, True), x, g_shard, c) for x in rs_b]
    ahead = c.is_gpu
    fwd_items = [(a, fwd_t * f, 0.0) for a, (_, f) in zip(ag, units)]
    bwd_items = [(a, bwd_t * f, r) for a, (_, f), r in zip(ag, units, rs)][::-1]
    f_el, f_wire, gap = pipelined(fwd_items, ahead, [(a, 0.0) for a in ag_save], idle)
    b_el, b_wire, _ = pipelined(bwd_items, True, list(zip(ag_save, rs_save))[::-1], gap)  # FSDP prefetches in backward
    return f_el, b_el, f_wire + b_wire


def comm_cost(prof: ModelProfile, c: Cluster, layout: Layout, s, bwd_window: float, nbytes: float,
              group: Group, rate: float, slow: float = 1.0) -> tuple[float, float, str | None]:
    """(wire s, exposed s, note) of ddp's gradient sync under ``--comm``."""
    spec = CommSpec.parse(layout.comm)  # the one parser of --comm
    kind = spec.kind
    if kind in ("none", "fp16", "bf16"):
        ratio = 1.0 if kind == "none" else 0.5
        wire, exposed = ddp_sync(nbytes, ratio, bwd_window, group, c, s.bucket_mib * 2**20)
        return wire, exposed, None
    if kind == "powersgd":
        from .model import powersgd_elements

        r = spec.rank
        sent = powersgd_elements(prof, r) * 4 / layout.dims.tp
        tiny = costs.allreduce(4, group, c)  # the latency of the two extra all-reduces (P, then Q)
        flops = sum(4 * m * n * r for m, n in prof.matrices if m * n >= 2 * r * (m + n)) / layout.dims.tp
        # its three all-reduces follow backward's compute, the link idle since the last step's:
        # the first ``burst`` bytes go at once where the link lets a burst through (costs.allreduce_after_idle)
        wire = costs.allreduce_after_idle(sent, group, c) + 2 * tiny
        # one bucket (dtrain's powersgd needs every gradient in one), so nothing overlaps backward;
        # its compression compute is the profile's where measured (in backward then), else FLOPs / rate
        compute = 0.0 if prof.machinery is not None else flops / rate
        return wire, wire + compute, f"powersgd:{r}: {sent / max(1.0, nbytes):.3f} of the gradient bytes"
    if kind == "localsgd":
        period = spec.period
        wire = costs.allreduce_after_idle(nbytes, group, c) / period  # after H steps of compute
        m = prof.machinery
        average = (m.average_s or 0.0) * slow / period if m is not None else 0.0
        return wire, wire + average, f"localsgd:{period}: parameters averaged every {period} steps (amortised)"
    raise ValueError(f"unknown comm {layout.comm!r}")


def pipeline_step(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd_t: float, bwd_t: float, params_rank: float,
                  groups: tuple[Group, Group, Group], measured: float | None = None) -> tuple[dict[str, float], float, float]:
    """(schedule phases, wire s, exposed s) of pp x dp: the schedule, then the dp sync. With
    ``measured`` (``paired_schedule``), the forward, backward and bubble are scaled to it and
    the sends cost what the job's link adds over the loopback it was measured on."""
    from .pipeline_sim import makespan

    d, b, m = layout.dims, s.batch, s.microbatches
    g_pp, g_rep, g_shard = groups
    nbytes = b / m * prof.boundary_bytes / d.tp

    def link(cl: Cluster, g: Group) -> tuple[float, float, float, float]:
        """A transfer's seconds, its slowdown by one the other way, what it saves after idle time,
        the latency of a message of no size (a receive's notice)."""
        cost = lambda x: costs.p2p(x, g, cl)  # noqa: E731
        paced = costs.paced_p2p(nbytes, g, cl)
        if paced is not None:  # sent below the link's rate: the shaper's bucket stays full, no burst to gain
            return paced, costs.crossing(nbytes, g, cl), 0.0, cost(1)
        return cost(nbytes), costs.crossing(nbytes, g, cl), costs.idle_saving(cost, "send_recv", nbytes, g, cl), cost(1)

    hop, crossed, save, latency = link(c, g_pp)
    # torch's schedule played out: every stage as slow as the busiest, each transfer on its link
    # in turn, waits where torch's schedule waits (pipeline_sim); what it adds beyond the
    # compute is the bubble ((p-1) slots) and the waits for transfers
    bubble = (d.pp - 1) * (fwd_t + bwd_t) / m
    if measured is not None:
        k = measured / max(1e-12, fwd_t + bwd_t + bubble)
        fwd_t, bwd_t, bubble = k * fwd_t, k * bwd_t, k * bubble
        l_hop, l_crossed, l_save, l_latency = link(*(paired_loopback(prof, c, "pp") or (c, Group(1, d.pp))))
        local = makespan(d.pp, m, fwd_t / m, bwd_t / m, l_hop, s.schedule, l_crossed, l_save, l_latency)
        phases = {"forward": fwd_t, "backward": bwd_t, "bubble": bubble,
                  "p2p": max(0.0, makespan(d.pp, m, fwd_t / m, bwd_t / m, hop, s.schedule, crossed, save, latency) - local)}
    else:
        span = makespan(d.pp, m, fwd_t / m, bwd_t / m, hop, s.schedule, crossed, save, latency)
        phases = {"bubble": bubble, "p2p": max(0.0, span - fwd_t - bwd_t - bubble)}
    wire = 2 * m * (d.pp - 1) * hop / d.pp
    grad_bytes = s.grad_comm_bytes * params_rank
    if d.dp_shard > 1:
        sync = costs.gather(s.param_comm_bytes * params_rank, g_shard, c) + costs.gather(grad_bytes, g_shard, c, reduce=True)
    else:
        sync = costs.allreduce(grad_bytes, g_rep, c)
    return phases, wire + sync, sync


def pair_slowdown(prof: ModelProfile, c: Cluster, s) -> float:
    """How much slower the world of two's ranks computed than the world of one (its two
    processes on the profile's cores, as ``Cluster.compute_slowdown`` has them for a job of two)."""
    m = prof.machinery
    other, by_session, measured = (m.other_load, m.by_session, m.corun_slowdown(2)) if m is not None else (0.0, False, None)
    return c.with_world(1, 2).compute_slowdown(s.threads_per_proc, other, by_session, measured=measured)


def measured_extra(prof: ModelProfile, c: Cluster, layout: Layout, s, slow: float) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds the layout's machinery adds to a step, as the
    profile measured it on this CPU (``machinery``), x the shared cores' slowdown (over the world
    of two's own, for a kind measured there: two processes already shared the cores); 0 unmeasured."""
    m = prof.machinery
    if m is None:
        return 0.0, 0.0, 0.0
    from .machinery import kinds_of

    f = b = o = 0.0
    for kind in kinds_of(layout):
        e = m.extra(kind)
        k = slow / pair_slowdown(prof, c, s) if m.paired(kind) else slow
        f, b, o = f + k * e.forward, b + k * e.backward, o + k * e.optimizer
    return f, b, o


def pipeline_compute(prof: ModelProfile, layout: Layout, s, f_share: float, slow: float) -> tuple[float, float] | None:
    """(forward, backward) seconds of the busiest stage's micro-batches from the profile: one
    micro-batch's own time (small batches run less efficiently) x the stage's share, plus the
    schedule's measured work per micro-batch (in forward); None unmeasured."""
    m = prof.machinery
    if m is None or "micro" not in m.steps or "pp" not in m.steps:
        return None
    mb, n = m.steps["micro"], s.microbatches
    schedule = max(0.0, m.steps["pp"].forward - m.microbatches * (mb.forward + mb.backward)) / m.microbatches
    return (n * (mb.forward * f_share / layout.dims.tp + schedule) * slow, n * mb.backward * f_share / layout.dims.tp * slow)


def paired_schedule(prof: ModelProfile, c: Cluster, layout: Layout, s, slow: float) -> float | None:
    """Seconds of the pipeline's schedule (its forwards, backwards, bubble, sends over loopback,
    the loss broadcast) as measured: where the job's processes outnumber the profile's cores, the
    layout itself in a world of the job's processes there (``Machinery.schedules``, ``coupled``),
    as it is; else, for two stages, the profile's world of two (two real stages, dtrain's ``Pipe``)
    x the job's slowdown over that world's own (two processes on the profile's cores). None where
    neither applies (not measured, other than 2 stages, TP inside, other micro-batching,
    activation checkpointing, which the world of two does not run)."""
    m, d = prof.machinery, layout.dims
    if (m is not None and (got := m.schedules.get(layout.name)) is not None and got[0] == c.world_size
            and c.oversubscribed(s.threads_per_proc) and (s.microbatches, s.batch) == (m.microbatches, m.batch)):
        return got[1]
    if (m is None or not m.paired("pp") or d.pp != 2 or d.tp != 1 or s.activation_checkpointing
            or (s.microbatches, s.batch) != (m.microbatches, m.batch)):
        return None
    return m.steps2["pp"].forward * slow / pair_slowdown(prof, c, s)


def step_phases(prof: ModelProfile, c: Cluster, layout: Layout, s, fwd: float, bwd: float, opt: float,
                slow: float) -> tuple[dict[str, float], float, list[str]]:
    """Phase -> seconds of one optimizer step on the busiest rank; wire seconds; notes."""
    from .model import recompute_s, stage_share

    d, ppn, b = layout.dims, c.procs_per_node, s.batch
    g_tp = group_of(d.tp, 1, ppn)
    g_shard = group_of(d.dp_shard, d.tp, ppn)
    g_rep = group_of(d.dp_replicate, d.tp * d.dp_shard, ppn)
    g_pp = group_of(d.pp, d.tp * d.dp, ppn)
    f_share, p_share, _ = stage_share(prof, d.pp)
    params_rank = prof.params * p_share / d.tp
    fwd_t = b * fwd * f_share / d.tp
    bwd_t = b * bwd * f_share / d.tp
    if d.pp > 1 and (piped := pipeline_compute(prof, layout, s, f_share, slow)) is not None:
        fwd_t, bwd_t = piped
    bwd_t += b * recompute_s(prof, c, s, fwd) * f_share / d.tp
    extra_f, extra_b, extra_o = measured_extra(prof, c, layout, s, slow)
    fwd_t, bwd_t = fwd_t + extra_f, bwd_t + extra_b
    phases = {"data": b * s.data_s_per_sample * slow, "forward": fwd_t, "backward": bwd_t}
    opt_t = opt * params_rank / (d.dp if layout.zero1 else d.dp_shard) + extra_o
    notes: list[str] = []
    wire, exposed = 0.0, 0.0
    grad_bytes = s.grad_comm_bytes * params_rank
    rate = prof.fwd_flops / fwd if fwd > 0 else 1e12
    if d.pp > 1:
        pp_phases, w, e = pipeline_step(prof, c, layout, s, fwd_t, bwd_t, params_rank, (g_pp, g_rep, g_shard),
                                        paired_schedule(prof, c, layout, s, slow))
        phases.update(pp_phases)
        wire, exposed = wire + w, exposed + e
        notes.append(f"pipeline bubble {(d.pp - 1) / (s.microbatches + d.pp - 1):.0%} of the schedule (m={s.microbatches}, p={d.pp})")
    elif d.dp_shard > 1:
        idle = phases["data"] + opt_t  # the link's rest since the last step's last scatter (at least)
        f_el, b_el, w = fsdp_step(prof, c, layout, s, fwd_t, bwd_t, g_shard, g_rep, idle)
        wire += w
        shown = (f_el - fwd_t) + (b_el - bwd_t)
        if (loop := paired_loopback(prof, c, "fsdp")) is not None:  # the paired phases hold the loopback's share
            lf, lb, _ = fsdp_step(prof, loop[0], layout, s, fwd_t, bwd_t, loop[1], Group(1, 1), idle)
            shown = max(0.0, shown - (lf - fwd_t) - (lb - bwd_t))
        exposed += shown
    elif d.dp_replicate > 1:
        window = bwd_t / max(1, s.grad_accum)  # only the last micro-batch's backward overlaps
        w, e, note = comm_cost(prof, c, layout, s, window, grad_bytes, g_rep, rate, slow)
        wire, exposed = wire + w, exposed + e
        if note:
            notes.append(note)
    more = serial_comm(prof, c, layout, s, params_rank, g_rep, g_tp)
    if layout.comm.startswith("localsgd") and (drift := drift_s(prof, c, phases["data"] + fwd_t + bwd_t + opt_t)):
        phases["drift"] = drift
        m = prof.machinery
        notes.append(f"localsgd: its ranks meet only to average and log, and between move at the slower's pace: "
                     f"x{m.drift_factor():.3f} of the compute (the world of two's stretches of {m.drift[0]} steps, measured)")
    phases["exposed_comm"] = exposed + more
    phases["log"] = log_step(c, s) / max(1, s.log_every)
    phases["optimizer"] = opt_t
    return phases, wire + more, notes


def drift_s(prof: ModelProfile, c: Cluster, compute_s: float) -> float:
    """Seconds a step of local SGD waits, on average, for the slower rank at the next meeting: the
    world of two's stretches without a meeting (``Machinery.drift_factor``) for a job of two on the
    profile's shared cores; 0 elsewhere (not measured: ranks on machines of their own, or more
    ranks, whose slowest lags more)."""
    m = prof.machinery
    factor = m.drift_factor() if m is not None and c.shared_cores and c.world_size == 2 else None
    return (factor - 1.0) * compute_s if factor else 0.0


def log_step(c: Cluster, s) -> float:
    """Seconds of the collectives a log step adds (every ``--log-every`` steps, on every rank):
    the loss's mean and the preemption check (an all-reduce of one number each), then the
    breakdown's all-gather of each rank's medians and p90s (``Observer._gather``). Each waits
    for every rank: where ranks drift apart between them (local SGD), also for the slowest
    (``drift_s``)."""
    from ..metrics.breakdown import STAT_KEYS

    world = Group(c.nodes, c.procs_per_node)
    per_rank = (2 * len(STAT_KEYS) + 2) * 8  # float64: medians, p90s, the step count, the peak memory
    return 2 * costs.allreduce(4, world, c) + costs.gather(per_rank * world.size, world, c)


def paired_loopback(prof: ModelProfile, c: Cluster, kind: str) -> tuple[Cluster, Group] | None:
    """(the cluster with the world of two's loopback figures inside a node, that world's group)
    where ``kind``'s phases come from the world of two (``Machinery.steps2``) and its loopback
    was timed: those phases hold the kind's collectives over loopback already, so the job's link
    is charged what it costs beyond them. None otherwise."""
    m = prof.machinery
    if m is None or m.loopback is None or not m.paired(kind):
        return None
    return replace(c, links={**c.links, "intra": m.loopback}), Group(1, 2)


def beyond_loopback(prof: ModelProfile, c: Cluster, kind: str, group: Group, cost: Callable[[Cluster, Group], float]) -> float:
    """``cost`` on the job's ``group``, less what it cost on the world of two's loopback where
    ``kind``'s measured phases already hold that (``paired_loopback``); never below 0."""
    out = cost(c, group)
    if (loop := paired_loopback(prof, c, kind)) is not None:
        out = max(0.0, out - cost(*loop))
    return out


def zero_sends(prof: ModelProfile, n: int, nbytes: float) -> list[tuple[int, float]]:
    """ZeRO's parameter broadcasts among ``n`` ranks, in the order torch issues them (owner by owner,
    each owner's tensors largest first): (owner, bytes), the profile's tensors scaled to ``nbytes``
    (a stage's or a TP shard's part); ``tensors`` equal ones where the profile has no sizes."""
    sizes = prof.tensor_sizes or (1,) * max(prof.tensors, n)
    scale = nbytes / sum(sizes)
    return [(r, e * scale) for r, e in costs.zero_broadcasts(sizes, n)]


def serial_comm(prof: ModelProfile, c: Cluster, layout: Layout, s, params_rank: float, g_rep: Group, g_tp: Group) -> float:
    """Seconds of the collectives nothing overlaps: zero1's parameter broadcasts, TP's activations."""
    out = 0.0
    if layout.zero1:
        # torch's ZeroRedundancyOptimizer broadcasts each parameter from the rank that stepped it
        # (parameters_as_bucket_view=False), issuing them all (async_op) before waiting: the link's
        # latency is paid once per sending rank, not per tensor (benchmarks/zero1_broadcasts.py: 38
        # tensors, 548 KB took 42.5 ms at 100 Mbit/s, its bytes' 43.8 ms; a latency per tensor said
        # 37 x 0.3 ms more). gloo runs them at once, so different owners' trees share the links
        # (costs.queued_broadcasts: two at a time, in issue order).
        out += beyond_loopback(prof, c, "zero1", g_rep,
                               lambda cl, g: costs.queued_broadcasts(zero_sends(prof, g.size, 4 * params_rank), g, cl,
                                                                     messages=min(prof.tensors, g.size)))
    if layout.dims.tp > 1:
        def tp(cl: Cluster, g: Group) -> float:
            per = costs.gather(s.batch * prof.boundary_bytes, g, cl)
            return 8 * len(prof.blocks) * per + 2 * costs.gather(s.batch * prof.out_bytes, g, cl)
        out += beyond_loopback(prof, c, "tp", g_tp, tp)
    return out
