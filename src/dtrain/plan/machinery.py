"""What each layout's own machinery costs on this CPU, measured in a short profile: the model's
step run plainly and under each layout's wrapping, in a fresh process that joins a process
group of one (as a `dtrain train` worker, with the worker's imports and one torch thread).

With one rank every collective is a local no-op, so what a layout adds to the plain step is its
CPU work: DDP's reducer and a ``--comm`` method's compute (the 16-bit casts, PowerSGD's matrix
products and orthogonalisation on this model's gradient shapes, local SGD's parameter
averaging), ``fully_shard``'s per-unit hooks and copies and its optimizer step on DTensors,
tensor parallelism's DTensor dispatch, ZeRO's partitioned step, and a pipeline schedule's
per-micro-batch work (one stage holding the whole model). The kinds run in turn, round after
round, so a load that comes and goes touches them alike; medians are kept. The link's part
(bytes, latency) is the link model's (``links``), not this one's.

The same process reports memory as a worker has it: the resident set before any model (the
interpreter, torch, dtrain, the process group, the task's data, the FLOP count's imports), what
a pipeline's modules add, and the peak of plain steps above that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import procfs
from .sharing import agree, drift_stretches

MIB = 2**20


@dataclass(frozen=True)
class Phases:
    """Median seconds of one step's phases."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


@dataclass(frozen=True, kw_only=True)
class Machinery:
    """The measurements (seconds, bytes) of one profile; see the module's docstring."""

    batch: int
    microbatches: int
    steps: dict[str, Phases]
    """By kind: ``plain``, ``micro`` (one micro-batch of ``batch / microbatches``, no optimizer),
    ``ddp:<comm>``, ``zero1``, ``fsdp``, ``tp``, ``pp`` (the whole step through a one-stage schedule)."""
    average_s: float | None = None
    """Local SGD's averaging of every parameter, once (torch's ``average_parameters``)."""
    rounds: int = 0
    rss: dict[str, float] = field(default_factory=dict)
    """Bytes: ``baseline`` (a worker before its model), ``pipelining`` (importing torch's
    pipelining adds), ``plain_peak`` (the peak of plain steps above the baseline)."""
    threads: int = 1
    other_load: float = 0.0
    """What else wanted the cores while the profile ran (sampled once a round): other sessions
    with a runnable thread where the kernel shares the CPU by session (``by_session``), else
    other runnable threads. The profile's times include it; ``Cluster.compute_slowdown`` counts
    it for processes that share the profile's cores."""
    by_session: bool = False
    """Linux's autogroups are on: the CPU is shared between sessions first (each `dtrain train`
    worker has a session of its own), then between a session's threads."""
    steps2: dict[str, Phases] = field(default_factory=dict)
    """The kinds of ``PAIRED`` (and ``plain``) measured again in a world of two local ranks over
    loopback, both stepping at once: what their machinery costs with a real second rank (DTensor's
    sharding propagation and redistributions, FSDP's copies in and out of its flat buffers, the
    backend's threads and the kernel's TCP work beside the compute) where a world of one runs every
    collective as a local no-op. DDP's and ZeRO's backward end with the graph's compute (their wait
    for the last all-reduce is the link model's); TP's and FSDP's phases hold their loopback waits."""
    corun: tuple[int, float, float] | None = None
    """(processes, plain step seconds of one alone, of each with that many running at once),
    measured where the job's processes share the profile's cores (``sharing.corun``); the ratio replaces
    ``Cluster.compute_slowdown``'s share of the cores for a job of that many processes."""
    schedules: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Pipeline layout (its ``--parallel`` string) -> (processes, seconds of its schedule) as the job
    runs it in a world of its processes on the profile's cores (``coupled``), where they outnumber them."""
    drift: tuple[int, list[tuple[float, float]]] | None = None
    """(steps per stretch, [(the slower rank's seconds, the ranks' mean seconds) per stretch]): the
    world of two's ranks stepping the plain step that many times without meeting (local SGD's
    steps between averagings), each stretch started together. ``drift_factor``."""
    loopback: Any = None
    """The collectives' figures (``links.Links``) between the world of two's ranks, timed in that
    world after its steps: what the loopback waits inside its TP, FSDP and ZeRO phases cost, so
    the model charges a job's link only what it adds to them (``steps.paired_loopback``)."""

    def corun_slowdown(self, processes: int) -> float | None:
        """The measured slowdown of ``processes`` plain steps at once over one alone, or None:
        ``corun``'s, or for two processes the world of two's plain step over the world of one's
        (its two ranks step at once, in the same rounds)."""
        if self.corun is not None and self.corun[0] == processes and self.corun[1] > 0:
            return self.corun[2] / self.corun[1]
        if processes == 2 and "plain" in self.steps2 and self.steps["plain"].total > 0:
            return self.steps2["plain"].total / self.steps["plain"].total
        return None

    def drift_factor(self) -> float | None:
        """How much longer the slower of two ranks takes over stretches without a meeting than the
        two on average (>= 1): a job whose ranks meet only every H steps moves at the slower's
        pace, while the profile's medians and the pair's mean see the average. None: not measured."""
        if not self.drift or not self.drift[1]:
            return None
        slow, mean = sum(s for s, _ in self.drift[1]), sum(m for _, m in self.drift[1])
        return max(1.0, slow / mean) if mean > 0 else None

    def paired(self, kind: str) -> bool:
        """Whether ``extra(kind)`` comes from the world of two."""
        return kind in self.steps2 and "plain" in self.steps2

    def extra(self, kind: str) -> Phases:
        """What ``kind`` adds to the plain step, per phase (0 where noise made it negative): from the
        world of two where it was measured there (``steps2``: over the plain step of that world,
        TP's over half of it, the share of the work each of its ranks does), else the world of one."""
        if self.paired(kind):
            base, got = self.steps2["plain"], self.steps2[kind]
            if kind == "tp":
                base = Phases(base.forward / 2, base.backward / 2, base.optimizer / 2)
        else:
            base, got = self.steps["plain"], self.steps.get(kind)
        if got is None:
            return Phases(0.0, 0.0, 0.0)
        return Phases(max(0.0, got.forward - base.forward), max(0.0, got.backward - base.backward),
                      max(0.0, got.optimizer - base.optimizer))

    def describe(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "threads": self.threads, "batch": self.batch, "microbatches": self.microbatches,
                "steps_ms": {k: {"forward": round(v.forward * 1e3, 3), "backward": round(v.backward * 1e3, 3),
                                 "optimizer": round(v.optimizer * 1e3, 3)} for k, v in self.steps.items()},
                "average_ms": None if self.average_s is None else round(self.average_s * 1e3, 3),
                "other_load": round(self.other_load, 2), "other_load_by": "sessions" if self.by_session else "threads",
                "rss_mib": {k: round(v / MIB, 1) for k, v in self.rss.items()},
                "steps2_ms": {k: {"forward": round(v.forward * 1e3, 3), "backward": round(v.backward * 1e3, 3),
                                  "optimizer": round(v.optimizer * 1e3, 3)} for k, v in self.steps2.items()},
                "corun": None if self.corun is None else {"processes": self.corun[0], "alone_ms": round(self.corun[1] * 1e3, 3),
                                                          "together_ms": round(self.corun[2] * 1e3, 3)},
                "schedules_ms": {k: {"processes": n, "schedule": round(t * 1e3, 3)} for k, (n, t) in self.schedules.items()},
                "drift": None if self.drift is None else {"steps": self.drift[0], "factor": self.drift_factor(),
                                                          "stretches_ms": [[round(a * 1e3, 2), round(b * 1e3, 2)] for a, b in self.drift[1]]},
                "loopback": None if self.loopback is None else self.loopback.describe()}


def kinds_of(layout: Any) -> list[str]:
    """The measured kinds whose extra cost ``layout`` pays (a pipeline's are its own: ``micro``, ``pp``)."""
    d = layout.dims
    if d.pp > 1:
        return []
    out = ["tp"] if d.tp > 1 else []
    if d.dp_shard > 1:
        out.append("fsdp")
    elif d.tp == 1 and layout.zero1:
        out.append("zero1")
    elif d.tp == 1 and d.dp_replicate > 1:
        out.append(f"ddp:{layout.comm}")
    return out


def kinds_for(layouts: list[Any]) -> list[str]:
    """The kinds a list of ``Layout`` needs measured."""
    out: list[str] = []
    for lay in layouts:
        out += ["micro", "pp"] if lay.dims.pp > 1 else kinds_of(lay)
    return list(dict.fromkeys(out))


def drift_steps(layouts: list[Any], cluster: Any, log_every: int = 20) -> int | None:
    """Steps between local SGD's meetings (its longest period among ``layouts``, at most
    ``log_every``: the log steps meet too) where its ranks' drift is measured: a job of two
    processes on the profile's shared cores (``Machinery.drift``), else None."""
    from ..comm.spec import CommSpec

    periods = [CommSpec.parse(lay.comm).period for lay in layouts if lay.comm.startswith("localsgd")]
    if not periods or not cluster.shared_cores or cluster.world_size != 2:
        return None
    return max(1, min(max(periods), log_every or max(periods)))


PAIRED = ("tp", "fsdp", "zero1", "pp")
"""Kinds measured again in a world of two (``Machinery.steps2``), besides DDP's none, bf16 and fp16."""


def paired_kinds(kinds: list[str]) -> list[str]:
    """Local SGD and PowerSGD stay in the world of one: with a second rank the step would hold
    local SGD's averaging (priced apart, once every H steps), and PowerSGD's compression runs in
    its futures' callbacks, after the graph's compute, where the paired backward stops."""
    return [k for k in kinds if k in PAIRED or k in ("ddp:none", "ddp:bf16", "ddp:fp16")]


def measure(task_spec: tuple[str, str | None, dict[str, str]], *, batch: int, precision: str, optimizer: str, kinds: list[str],
            microbatches: int = 4, schedule: str = "1f1b", threads: int = 1, budget_s: float = 10.0,
            paired: bool = False, drift_steps: int | None = None) -> Machinery:
    """Run the profile in a fresh process (a world of one) and return its measurements; with
    ``paired`` (a job of several processes), the plain step and the kinds that talk inside the
    step again in a fresh world of two local ranks (``Machinery.steps2``; half of ``budget_s``),
    and with ``drift_steps`` there stretches of that many plain steps without a meeting
    (``Machinery.drift``; a quarter of ``budget_s`` more)."""
    from ..launch.local import run_distributed

    spec = {"task": task_spec, "batch": batch, "precision": precision, "optimizer": optimizer, "kinds": kinds,
            "microbatches": microbatches, "schedule": schedule, "threads": threads, "budget_s": budget_s}
    env = {"OMP_NUM_THREADS": str(threads)}
    raw = run_distributed(body, spec, world_size=1, timeout=120 + 4 * budget_s, env=env)[0]
    steps2: dict[str, Phases] = {}
    loopback, drift = None, None
    if paired:  # the plain step at least: two processes' slowdown (``corun_slowdown``), and the loopback
        import os

        from .links import from_measurement

        got = run_distributed(body, {**spec, "kinds": paired_kinds(kinds), "budget_s": budget_s / 2, "drift_steps": drift_steps},
                              world_size=2, timeout=120 + 4 * budget_s, env=env)
        steps2 = {k: Phases(*(statistics.mean(r["steps"][k][i] for r in got) for i in range(3))) for k in got[0]["steps"]}
        drift = (drift_steps, got[0]["drift"]) if got[0].get("drift") else None
        loopback = from_measurement(got[0]["loopback"], ranks=2, between="processes", backend="gloo", load=os.getloadavg()[0])
    return Machinery(batch=batch, microbatches=microbatches, steps={k: Phases(*v) for k, v in raw["steps"].items()},
                     average_s=raw["average_s"], rounds=raw["rounds"], rss=raw["rss"], threads=threads, other_load=raw["other_load"],
                     by_session=raw["by_session"], steps2=steps2, loopback=loopback, drift=drift)


def body(spec: dict[str, Any]) -> dict[str, Any]:
    """The profile, in a fresh process of a world of one (or two, ``measure(paired=True)``).
    Collective: every rank runs the same kinds in the same order, rank 0 decides the rounds."""
    import torch
    import torch.distributed as dist

    from ..tasks import load_task
    from ..train import loop  # noqa: F401 - a worker's imports, for its baseline memory
    from .profile import count
    from .timing import sample_batch

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    name, data_dir, options = spec["task"]
    task = load_task(name, data_dir=data_dir, options=options)
    x, y = sample_batch(task, spec["batch"])
    count(task.build_model, x, y, task.loss_fn, blocks=task.blocks, autocast_dtype=None)  # as a worker counts its FLOPs
    rss = {"baseline": procfs.status("VmRSS")}
    if "pp" in spec["kinds"]:
        import torch.distributed.pipelining  # noqa: F401 - what a pipeline's worker imports besides

        rss["pipelining"] = max(0.0, procfs.status("VmRSS") - rss["baseline"])
    runners = _runners(task, x, y, spec)
    peak_known = procfs.reset_peak()
    before = procfs.status("VmRSS")
    for _ in range(2):
        runners["plain"]()
    if peak_known:
        rss["plain_peak"] = max(0.0, procfs.status("VmHWM") - before)
    steps, rounds, (other, by_group) = _rounds(runners, spec["budget_s"])
    average = _average_s(task, runners) if any(k.startswith("ddp:localsgd") for k in spec["kinds"]) else None
    drift = drift_stretches(runners["plain"], spec["drift_steps"], spec["budget_s"] / 2) if spec.get("drift_steps") else None
    loopback = None
    if dist.get_world_size() > 1:  # the collectives between these ranks, as the steps just had them
        from ..diag.probe import LINK_SIZES, time_collectives

        loopback = time_collectives(torch.device("cpu"), LINK_SIZES, 7)  # 7: small sizes on a busy host are noisy
    dist.destroy_process_group()
    return {"steps": steps, "rounds": rounds, "average_s": average, "rss": rss, "other_load": other, "by_session": by_group,
            "loopback": loopback, "drift": drift}


MAX_ROUNDS = 60
"""At most this many rounds (within ``budget_s``). With 15, a window of about a second for the bed's
small lm, the world of two's plain forward came out a median 2%, 11% and 12% below what the two
ranks then ran in training (bed runs 11, 12, 14; 12 ddp rows each, -36% to +36%); 60 rounds span
the budget and met the machine's slower moments too (lm-20m local SGD, 4 plans each, alternating:
50.8 ms predicted on average with 60, 45.9 with 15; training ran 46.5-58.6)."""


def _rounds(runners: dict[str, Callable[[], tuple[float, float, float]]], budget_s: float) -> tuple[dict[str, tuple], int, float]:
    """Every runner once per round (3 warm-up rounds: PowerSGD compresses from its third step),
    then rounds until ``budget_s`` is spent (at least 3, at most ``MAX_ROUNDS``); per-phase medians, and the
    mean of the other runnable threads sampled after each step."""
    for _ in range(3):
        for run in runners.values():
            run()
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in runners}
    order, others, by_group = list(runners), [], procfs.autogroups_on()
    start, rounds = time.perf_counter(), 0
    while agree(rounds < MAX_ROUNDS and (rounds < 3 or time.perf_counter() - start < budget_s)):
        for k in order[rounds % len(order):] + order[:rounds % len(order)]:  # each kind first in turn
            times[k].append(runners[k]())
        others.append(procfs.runnable_others(by_group))  # once a round: reading every thread's state takes a while
        rounds += 1
    seen = [o for o in others if o is not None]
    other = statistics.mean(seen) if seen else 0.0
    return {k: tuple(statistics.median(t[i] for t in v) for i in range(3)) for k, v in times.items()}, rounds, (other, by_group)


def _runners(task: Any, x: Any, y: Any, spec: dict[str, Any]) -> dict[str, Callable[[], tuple[float, float, float]]]:
    import torch.distributed as dist

    from ..errors import ConfigError
    from .machinery_kinds import build_runner

    out = {"plain": build_runner("plain", task, x, y, spec)}
    for kind in spec["kinds"]:
        try:
            out[kind] = build_runner(kind, task, x, y, spec)
        except ConfigError:
            if kind != "pp" or dist.get_world_size() == 1:
                raise
            # two real stages need an nn.Sequential and a batch the micro-batches divide: the same
            # answer on every rank, so every rank leaves it out (the model keeps the world of one's)
    return out


def _average_s(task: Any, runners: dict[str, Any]) -> float:
    """Median seconds of one averaging of every parameter (post-local SGD's, every H steps)."""
    import torch
    from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups

    torch.manual_seed(0)
    params = [p for p in task.new_model().parameters() if p.requires_grad]
    for p in params:  # torch averages only parameters that have a gradient
        p.grad = torch.zeros_like(p)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        average_parameters_or_parameter_groups(params, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])
