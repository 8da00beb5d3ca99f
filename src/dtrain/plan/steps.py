"""One step of a layout, phase by phase (seconds): the collectives each layout issues, what
backward hides of them, a pipeline schedule played out. ``model.predict`` adds memory around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..comm.spec import CommSpec
from . import costs
from .cluster import Cluster
from .costs import Group, group_of
from .layouts import Layout
from .machinery import kinds_of
from .profile import ModelProfile


def stage_share(prof: ModelProfile, pp: int) -> tuple[float, float, float]:
    """(compute, parameter, activation) share of the busiest of ``pp`` stages, each at its largest: the blocks
    split as ``parallel.pipeline`` cuts them, the layers before them (``before_blocks``) on the first stage,
    those after them (the head) on the last; not known: half of what is outside the blocks at each end."""
    if pp <= 1 or not prof.blocks:
        return 1.0, 1.0, 1.0

    def load(blocks: Any, extra: Any = (0.0, 0.0, 0.0)) -> list[float]:
        return [sum((b.fwd_flops, b.params, b.act_bytes)[i] for b in blocks) + extra[i] for i in range(3)]

    n, total = len(prof.blocks), (prof.fwd_flops, prof.params, prof.act_bytes)
    rest = [t - x for t, x in zip(total, load(prof.blocks))]
    first = [r / 2 for r in rest] if prof.before_blocks is None else load([prof.before_blocks])
    ends = {0: first, pp - 1: [r - f for r, f in zip(rest, first)]}
    stages = [load(prof.blocks[n * s // pp:n * (s + 1) // pp], ends.get(s, (0.0, 0.0, 0.0))) for s in range(pp)]
    return tuple(max(st[i] for st in stages) / max(1.0, total[i]) for i in range(3))


def recompute_s(prof: ModelProfile, c: Cluster, s: Any, fwd: float) -> float:
    """Seconds per sample activation checkpointing adds: a forward of the blocks (none where the
    step was timed checkpointed on the device planned for)."""
    t = prof.timing
    if not s.activation_checkpointing or (t is not None and t.checkpointed and (not c.is_gpu or c.device.profiled)):
        return 0.0
    return fwd * (min(1.0, sum(b.fwd_flops for b in prof.blocks) / prof.fwd_flops) if prof.fwd_flops else 0.0)


def powersgd_elements(prof: ModelProfile, rank: int) -> float:
    """Elements PowerSGD sends: P and Q of each matrix it halves at least (torch's rule), the rest whole."""
    sent = sum(rank * (m + n) if m * n >= 2 * rank * (m + n) else m * n for m, n in prof.matrices)
    return sent + max(0, prof.params - sum(m * n for m, n in prof.matrices))


def fsdp_units(prof: ModelProfile, s: Any) -> list[tuple[float, int, float]]:
    """(bytes gathered, parameters, forward share) of each FSDP unit in forward order: the root
    (embeddings, head), then the blocks; converted weights in 1 byte under float8 (tensorwise)."""
    f8 = prof.float8 if s.precision == "float8" else None
    n = len(prof.blocks)
    in_blocks = list(f8.block_params) if f8 is not None and len(f8.block_params) == n else [0] * n
    rest_p = max(0, prof.params - sum(b.params for b in prof.blocks))
    rest_f = max(0.0, prof.fwd_flops - sum(b.fwd_flops for b in prof.blocks))
    units = [(rest_p, rest_f, f8.params - sum(in_blocks) if f8 is not None else 0)]
    units += [(b.params, b.fwd_flops, f) for b, f in zip(prof.blocks, in_blocks)]
    total, by = prof.fwd_flops or 1.0, s.param_comm_bytes
    return [(by * p - (by - 1) * f8p, p, fl / total) for p, fl, f8p in units if p > 0 or fl > 0]


def ddp_sync(nbytes: float, ratio: float, window: float, group: Group, c: Cluster, bucket: float) -> tuple[float, float]:
    """(wire s, exposed s) of DDP's buckets (``ratio`` x ``nbytes``), each all-reduced in turn once
    a backward of ``window`` seconds has produced it (evenly by bytes)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0, 0.0
    free = wire = 0.0
    for i in range(max(1, math.ceil(nbytes / bucket))):
        size = min(bucket, nbytes - i * bucket)
        t = costs.allreduce(size * ratio, group, c)
        free = max(free, window * min(1.0, (i * bucket + size) / nbytes)) + t
        wire += t
    return wire, max(0.0, free - window)


def pipelined(items: list[tuple[float, float, float]], ahead: bool) -> tuple[float, float]:
    """(elapsed, wire) of units each a gather, compute, a scatter (s) on one link in issue order;
    ``ahead``: the next gather issued as this compute starts (FSDP's prefetch)."""
    if not items:
        return 0.0, 0.0
    free = gather_end = items[0][0]
    comp_end = 0.0
    for i, (_, comp, scatter) in enumerate(items):
        start = max(comp_end, gather_end)
        comp_end = start + comp
        if i + 1 < len(items):
            gather_end = max(free, start if ahead else comp_end) + items[i + 1][0]
            free = gather_end if items[i + 1][0] > 0 else free
        if scatter > 0:
            free = max(free, comp_end) + scatter
    return max(comp_end, free), sum(g + s for g, _, s in items)


def fsdp_step(prof: ModelProfile, c: Cluster, layout: Layout, s: Any, fwd_t: float, bwd_t: float,
              g_shard: Group, g_rep: Group) -> tuple[float, float, float]:
    """(forward elapsed, backward elapsed, wire) under fsdp/hsdp: each unit gathered in forward and
    in backward, one ahead; its gradient reduce-scattered (hsdp: then all-reduced across replicas)."""
    tp, units = layout.dims.tp, fsdp_units(prof, s)
    ag = [costs.gather(g / tp, g_shard, c) for g, _, _ in units]
    rs = [costs.gather(x, g_shard, c, reduce=True) + costs.allreduce(x / g_shard.size, g_rep, c)
          for x in (s.grad_comm_bytes * p / tp for _, p, _ in units)]
    f_el, f_wire = pipelined([(a, fwd_t * f, 0.0) for a, (_, _, f) in zip(ag, units)], c.is_gpu)
    b_el, b_wire = pipelined([(a, bwd_t * f, r) for a, (_, _, f), r in zip(ag, units, rs)][::-1], True)
    return f_el, b_el, f_wire + b_wire


def comm_cost(prof: ModelProfile, c: Cluster, layout: Layout, s: Any, bwd_window: float, nbytes: float,
              group: Group) -> tuple[float, float, str | None]:
    """(wire s, exposed s, note) of ddp's gradient sync under ``--comm``."""
    spec = CommSpec.parse(layout.comm)
    if spec.kind in ("none", "fp16", "bf16"):
        wire, exposed = ddp_sync(nbytes, 1.0 if spec.kind == "none" else 0.5, bwd_window, group, c, s.bucket_mib * 2**20)
        return wire, exposed, None
    if spec.kind == "powersgd":
        r = spec.rank
        sent = powersgd_elements(prof, r) * 4 / layout.dims.tp
        # three all-reduces (P, Q, the uncompressed rest) after backward: one bucket, nothing overlaps; the
        # compression's own work: in a CPU's measured backward, under 0.1% of a GPU preset's step (plan_terms.py)
        wire = costs.allreduce(sent, group, c) + 2 * costs.allreduce(4, group, c)
        return wire, wire, f"powersgd:{r}: {sent / max(1.0, nbytes):.3f} of the gradient bytes"
    if spec.kind == "localsgd":
        wire = costs.allreduce(nbytes, group, c) / spec.period
        return wire, wire, f"localsgd:{spec.period}: parameters averaged every {spec.period} steps (amortised)"
    raise ValueError(f"unknown comm {layout.comm!r}")


def pipeline_step(prof: ModelProfile, c: Cluster, layout: Layout, s: Any, fwd_t: float, bwd_t: float, params_rank: float,
                  groups: tuple[Group, Group, Group]) -> tuple[dict[str, float], float, float]:
    """(schedule phases, wire s, exposed s) of pp x dp: torch's schedule played out, then the dp sync."""
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


def step_phases(prof: ModelProfile, c: Cluster, layout: Layout, s: Any, fwd: float, bwd: float,
                opt: float) -> tuple[dict[str, float], float, list[str]]:
    """Phase -> seconds of one optimizer step on the busiest rank; wire seconds; notes."""
    d, ppn, b = layout.dims, c.procs_per_node, s.batch
    g_tp, g_shard = group_of(d.tp, 1, ppn), group_of(d.dp_shard, d.tp, ppn)
    g_rep, g_pp = group_of(d.dp_replicate, d.tp * d.dp_shard, ppn), group_of(d.pp, d.tp * d.dp, ppn)
    f_share, p_share, _ = stage_share(prof, d.pp)
    params_rank = prof.params * p_share / d.tp
    fwd_t, bwd_t = b * fwd * f_share / d.tp, b * bwd * f_share / d.tp
    m = prof.machinery
    if d.pp > 1 and m is not None and "micro" in m.steps and "pp" in m.steps:
        # on this CPU: a measured micro-batch x the stage's share, plus the schedule's own work per micro-batch
        mb, n = m.steps["micro"], s.microbatches
        schedule = max(0.0, m.steps["pp"].forward - m.microbatches * (mb.forward + mb.backward)) / m.microbatches
        fwd_t, bwd_t = n * (mb.forward * f_share / d.tp + schedule), n * mb.backward * f_share / d.tp
    bwd_t += b * recompute_s(prof, c, s, fwd) * f_share / d.tp
    # what the layout's machinery adds on this CPU (``machinery``; 0 unmeasured)
    extra_f, extra_b, extra_o = (sum(ph) for ph in zip((0.0, 0.0, 0.0), *(m.extra(k) for k in kinds_of(layout)))) if m else (0.0,) * 3
    fwd_t, bwd_t = fwd_t + extra_f, bwd_t + extra_b
    phases = {"data": b * s.data_s_per_sample, "forward": fwd_t, "backward": bwd_t}
    opt_t = opt * params_rank / (d.dp if layout.zero1 else d.dp_shard) + extra_o
    notes, wire, exposed = [], 0.0, 0.0
    if d.pp > 1:
        pp_phases, wire, exposed = pipeline_step(prof, c, layout, s, fwd_t, bwd_t, params_rank, (g_pp, g_rep, g_shard))
        phases.update(pp_phases)
        notes.append(f"pipeline bubble {(d.pp - 1) / (s.microbatches + d.pp - 1):.0%} of the schedule (m={s.microbatches}, p={d.pp})")
    elif d.dp_shard > 1:
        f_el, b_el, wire = fsdp_step(prof, c, layout, s, fwd_t, bwd_t, g_shard, g_rep)
        exposed = (f_el - fwd_t) + (b_el - bwd_t)
    elif d.dp_replicate > 1:
        window = bwd_t / max(1, s.grad_accum)  # only the last micro-batch's backward overlaps
        wire, exposed, note = comm_cost(prof, c, layout, s, window, s.grad_comm_bytes * params_rank, g_rep)
        notes += [note] if note else []
    more = serial_comm(prof, c, layout, s, params_rank, g_rep, g_tp)
    phases.update(exposed_comm=exposed + more, log=log_step(c, s) / max(1, s.log_every), optimizer=opt_t)
    return phases, wire + more, notes


def log_step(c: Cluster, s: Any) -> float:
    """Seconds a log step's collectives take: two one-number all-reduces (the loss, the preemption
    check), the breakdown's all-gather of each rank's medians and p90s."""
    from ..metrics.breakdown import STAT_KEYS

    world = Group(c.nodes, c.procs_per_node)
    per_rank = (2 * len(STAT_KEYS) + 2) * 8  # float64: medians, p90s, the step count, the peak memory
    return 2 * costs.allreduce(4, world, c) + costs.gather(per_rank * world.size, world, c)


def serial_comm(prof: ModelProfile, c: Cluster, layout: Layout, s: Any, params_rank: float, g_rep: Group, g_tp: Group) -> float:
    """Seconds of the collectives nothing overlaps: zero1's parameter broadcasts, TP's activations."""
    out = 0.0
    if layout.zero1:
        # torch's ZeroRedundancyOptimizer issues every broadcast before waiting: a latency per owner, not per tensor
        out += costs.broadcast(4 * params_rank, g_rep, c, messages=min(prof.tensors, g_rep.size))
    if layout.dims.tp > 1:
        out += 8 * len(prof.blocks) * costs.gather(s.batch * prof.boundary_bytes, g_tp, c) + 2 * costs.gather(s.batch * prof.out_bytes, g_tp, c)
    return out


# A pipeline schedule played out in time. Each stage runs torch's order (ScheduleGPipe, Schedule1F1B):
# 1F1B fires each send with the next receive and waits for both, GPipe waits for its sends at the end of
# each pass. A send moves nothing before its receive is posted (torch posts it where it waits) and the
# notice has crossed: a transfer starts at the later of its send and the post plus one latency, holds its
# link for its time less that latency, and arrives one latency after. Transfers of no time: (m + p - 1) slots.
@dataclass
class _Link:
    """One direction between two neighbouring stages: transfers in the order they were fired."""

    hop: float
    latency: float = 0.0
    free: float = 0.0
    ends: dict[int, float] = field(default_factory=dict)
    fired: dict[int, float] = field(default_factory=dict)
    posted: dict[int, float] = field(default_factory=dict)

    def mark(self, side: dict[int, float], mb: int, at: float) -> None:
        """A send fired or a receive posted (``side``); the transfer moves once both are."""
        side.setdefault(mb, at)
        if mb in self.ends or mb not in self.fired or mb not in self.posted:
            return
        start = max(self.free, self.fired[mb], self.posted[mb] + self.latency)
        end = start + max(0.0, self.hop - self.latency)
        self.free = end if end > start else self.free  # a transfer of no wire time leaves the link as it was
        self.ends[mb] = end + min(self.latency, self.hop)


def _program(s: int, p: int, m: int, schedule: str) -> list[tuple]:
    """Stage ``s``'s operations: ("F"|"B", mb), ("fire", link, mb), ("wait", [(link, mb), ...])."""
    first, last = s == 0, s == p - 1
    recv_act, recv_grad = ([] if first else [("act", s - 1)]), ([] if last else [("grad", s)])
    send_act, send_grad = ([] if last else [("act", s)]), ([] if first else [("grad", s - 1)])
    ops: list[tuple] = []
    if schedule == "gpipe":
        for recv, op, send in ((recv_act, "F", send_act), (recv_grad, "B", send_grad)):
            for i in range(m):
                ops += [("wait", [(k, i) for k in recv]), (op, i)] + [("fire", k, i) for k in send]
            ops.append(("wait", [(k, i) for k in send for i in range(m)]))
        return ops
    warmup, f, b = min(m, p - s), 0, 0
    for _ in range(warmup):
        ops += [("wait", [(k, f) for k in recv_act]), ("F", f), ("wait", [(k, f - 1) for k in send_act if f > 0])]
        if f < warmup - 1:
            ops += [("fire", k, f) for k in send_act]
        f += 1
    pending = [(k, f - 1) for k in send_act]  # the last warm-up send, fused with the first backward's receive
    while b < m:
        ops += [("fire", k, i) for k, i in pending] + [("wait", pending + [(k, b) for k in recv_grad]), ("B", b)]
        pending, b = [(k, b) for k in send_grad], b + 1
        if f < m:
            ops += [("fire", k, i) for k, i in pending] + [("wait", pending + [(k, f) for k in recv_act]), ("F", f)]
            pending, f = [(k, f) for k in send_act], f + 1
    return ops + [("fire", k, i) for k, i in pending] + [("wait", pending)]


def makespan(p: int, m: int, fwd: float, bwd: float, hop: float, schedule: str = "1f1b", latency: float = 0.0) -> float:
    """Seconds from the first forward to the last stage's end: ``p`` stages of ``m`` micro-batches of
    ``fwd`` + ``bwd`` s each, each transfer ``hop`` s to arrive (``latency`` of it one way)."""
    links = {(k, s): _Link(hop, latency) for k in ("act", "grad") for s in range(p - 1)}
    receiver = {(k, s): s + 1 if k == "act" else s for k, s in links}
    programs = [_program(s, p, m, schedule) for s in range(p)]
    pc, clock = [0] * p, [0.0] * p
    while any(pc[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(programs[s]):
                op = programs[s][pc[s]]
                if op[0] == "wait":
                    for k, i in op[1]:
                        if receiver[k] == s:  # torch posts a receive where it waits for it
                            links[k].mark(links[k].posted, i, clock[s])
                    needed = [links[k].ends.get(i) for k, i in op[1]]
                    if any(t is None for t in needed):
                        break  # the other stage has not fired it yet
                    clock[s] = max([clock[s], *needed])
                elif op[0] == "fire":
                    links[op[1]].mark(links[op[1]].fired, op[2], clock[s])
                else:
                    clock[s] += fwd if op[0] == "F" else bwd
                pc[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule deadlocked (p={p}, m={m}, {schedule})")  # a bug of this model
    return max(clock)
