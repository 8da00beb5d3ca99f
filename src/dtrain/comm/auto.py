"""``--comm auto``: measure this link and this model during the warm-up (two plain steps, then
PowerSGD at rank ``PROBE``, cheap on any link), then pick the lightest method that keeps exposed
communication under ~10% of a step. The rank that arrives last waits only for the wire, so the
minimum wait over ranks is the communication; other methods are predicted from their bytes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._log import logger
from . import methods

#: Exposed communication allowed, as a fraction of a step's compute.
TARGET = 0.10
#: From lightest (closest to plain synchronous SGD) to heaviest.
CANDIDATES = ("none", "bf16", "powersgd:4", "powersgd:2", "powersgd:1", "localsgd:4", "localsgd:8", "localsgd:16", "localsgd:32", "localsgd:64")
#: PowerSGD's rank during the warm-up (kept if auto chooses it).
PROBE = 4
_PLAIN = 2  # plain steps torch's PowerSGD insists on (DDP rebuilds its buckets after the first)


@dataclass(frozen=True, kw_only=True)
class LinkMeasurement:
    compute_ms: float
    """A step's compute on the slowest rank (forward, backward, optimizer, data)."""
    allreduce_ms: float
    """All-reduce of the whole fp32 gradient."""
    latency_ms: float
    """All-reduce of one element."""
    grad_bytes: int
    powersgd_numel: dict[int, int]
    """Elements PowerSGD sends per step, by rank (P, Q and the uncompressed tensors)."""
    powersgd_ms: float | None = None
    """A PowerSGD step at rank ``PROBE`` as measured (None: predicted from bytes alone)."""

    @property
    def bytes_per_s(self) -> float:
        return self.grad_bytes / max((self.allreduce_ms - self.latency_ms) / 1e3, 1e-9)

    def predicted_ms(self, candidate: str) -> float:
        """Communication per step (amortised) that ``candidate`` would expose."""
        kind, _, arg = candidate.partition(":")
        lat, bw = self.latency_ms, self.bytes_per_s
        if kind == "none":
            return self.allreduce_ms
        if kind in ("fp16", "bf16"):
            return lat + self.grad_bytes / 2 / bw * 1e3
        if kind == "powersgd":  # three all-reduces: uncompressed tensors, P, Q
            by_bytes = 3 * lat + self.powersgd_numel[int(arg)] * 4 / bw * 1e3
            if self.powersgd_ms is None:
                return by_bytes
            return self.powersgd_ms * by_bytes / max(3 * lat + self.powersgd_numel[PROBE] * 4 / bw * 1e3, 1e-9)
        if kind == "localsgd":  # the parameters, once every H steps
            return self.allreduce_ms / int(arg)
        raise AssertionError(candidate)


def choose(m: LinkMeasurement, target: float = TARGET) -> tuple[str, dict[str, float]]:
    """The first candidate whose exposed communication is <= ``target`` of compute (else the one
    exposing least), and every candidate's predicted fraction."""
    fractions = {c: m.predicted_ms(c) / max(m.compute_ms, 1e-6) for c in CANDIDATES}
    for c, f in fractions.items():
        if f <= target:
            return c, fractions
    return min(fractions, key=fractions.__getitem__), fractions


class Auto:
    """Plain all-reduce, then PowerSGD while measuring; then the chosen method (see the module's docstring)."""

    def __init__(self, warmup: int, shapes: list[torch.Size]) -> None:
        self.warmup = warmup
        self.shapes = shapes
        self.iter = 0
        self.choice: str | None = None
        self.report: dict[str, Any] | None = None
        self.method: Any = None
        self._probe = methods.PowerSGD(PROBE, warmup=_PLAIN)
        self._t_hook = self._t_done = self._t_step = 0.0
        self._stepped_iter = -1
        self._samples: list[tuple[float, float]] = []  # (wall, wait) of steps _PLAIN, _PLAIN + 1, ...
        self._optimizers: list[torch.optim.Optimizer] = []

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.append(optimizer)
        if self.method is not None and hasattr(self.method, "register_optimizer"):
            self.method.register_optimizer(optimizer)

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.method is not None:
            return self.method.communicate(bucket)
        last = bucket.is_last()
        if last:
            self.iter += 1
            self._t_hook = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            if last:
                self._t_done = time.perf_counter()
            return fut.value()

        return self._probe.communicate(bucket).then(done)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank, after every optimizer step (decides at the warm-up's end)."""
        if self.method is not None:
            self.method.after_step(optimizer)
            return
        if self.iter == self._stepped_iter:
            return  # a second optimizer in the same step
        self._stepped_iter = self.iter
        now = time.perf_counter()
        if self.iter >= _PLAIN and self._t_step > 0:
            self._samples.append((now - self._t_step, self._t_done - self._t_hook))
        self._t_step = now
        if self.iter >= self.warmup:
            self._decide()

    def _decide(self) -> None:
        m = self._measure()
        choice, fractions = choose(m)
        report = {"choice": choice, **{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(m).items() if k != "powersgd_numel"},
                  "mb_per_s": round(m.bytes_per_s / 1e6, 2), "exposed_fraction": {c: round(f, 4) for c, f in fractions.items()}}
        box = [(choice, report)]
        dist.broadcast_object_list(box, src=0)  # one decision for all ranks: rank 0's
        self._adopt(*box[0])
        if dist.get_rank() == 0:
            shown = ", ".join(f"{c} {f:.1%}" for c, f in fractions.items())
            logger.warning(  # a warning, so it also shows in scripts that configure no logging
                f"--comm auto: compute {m.compute_ms:.1f} ms/step; all-reduce of {m.grad_bytes / 1e6:.2f} MB gradients "
                f"{m.allreduce_ms:.1f} ms (latency {m.latency_ms:.2f} ms, {m.bytes_per_s / 1e6:.1f} MB/s); powersgd:{PROBE} "
                f"{m.powersgd_ms:.1f} ms/step measured; predicted exposed "
                f"communication per step: {shown}; chose {choice} (target <= {TARGET:.0%})."
            )

    def _measure(self) -> LinkMeasurement:
        """Collective: every rank."""
        mine = torch.tensor(self._samples, dtype=torch.float64).reshape(-1, 2)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        stacked = torch.stack(every)  # ranks x steps x (wall, wait); step 0 is the last plain one
        comm = stacked[..., 1].min(0).values
        compute = (stacked[:, 1:, 0] - stacked[:, 1:, 1]).max(0).values  # the plain step's forward rebuilt DDP's buckets
        one = torch.zeros(1)
        lat = []
        for _ in range(5):
            t0 = time.perf_counter()
            dist.all_reduce(one)
            lat.append(time.perf_counter() - t0)
        numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        return LinkMeasurement(
            compute_ms=float(compute.median()) * 1e3, allreduce_ms=float(comm[0]) * 1e3,
            latency_ms=statistics.median(lat) * 1e3, grad_bytes=numel * 4,
            powersgd_numel={r: sum(methods.powersgd_numel(self.shapes, r)) for r in (1, 2, 4)},
            powersgd_ms=float(comm[1:].median()) * 1e3,
        )

    def _adopt(self, choice: str, report: dict[str, Any] | None, *, keep_probe: bool = True) -> None:
        kind, _, arg = choice.partition(":")
        self.choice, self.report = choice, report
        if keep_probe and choice == f"powersgd:{PROBE}":
            self.method = self._probe  # already running: its error feedback and warm start go on
        elif kind == "powersgd":
            self.method = methods.PowerSGD(int(arg), warmup=2)
            self.method.state.iter = 2  # the buckets settled during our warm-up
            self.method._fresh_ddp = False
        else:
            self.method = methods.build(kind, period=int(arg or 1), warmup=0)
        for optimizer in self._optimizers if hasattr(self.method, "register_optimizer") else ():
            self.method.register_optimizer(optimizer)

    def state_dict(self) -> dict[str, Any]:
        inner = self.method.state_dict() if self.method is not None else {"shared": {}, "local": {}}
        return {"shared": {"iter": self.iter, "choice": self.choice, "report": self.report, "method": inner["shared"]},
                "local": {"method": inner["local"]}}

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        shared = state["shared"]
        if shared["choice"] is None:  # saved during the warm-up: measure again, in this DDP
            self.iter, self._samples, self._t_step = 0, [], 0.0
            self._probe = methods.PowerSGD(PROBE, warmup=_PLAIN)
            return
        self.iter = int(shared["iter"])
        self._adopt(shared["choice"], shared["report"], keep_probe=False)
        if isinstance(self.method, methods.PowerSGD):
            self.method._fresh_ddp = True  # resumed into a new DDP (see PowerSGD.communicate)
        self.method.load_state_dict({"shared": shared["method"], "local": state["local"]["method"]}, same_ranks=same_ranks)
