"""What ``dtrain train`` observes beyond the loss: every rank's step breakdown per log interval,
stragglers named with their cause."""

from __future__ import annotations

import math
import socket
import time
from typing import Any

import torch

from .._log import logger
from ..errors import ConfigError
from ..metrics.breakdown import StepBreakdown, pack, unpack
from ..metrics.flops import count_step_flops, peak_flops, utilisation
from ..metrics.links import payload_bytes, probe
from ..metrics.memory import peak_memory
from ..metrics.stragglers import StragglerConfig, StragglerDetector
from ..metrics.tensorboard import TensorBoardSink
from ..metrics.trace import Tracer, parse_steps


class Observer:
    """Reads the Context's breakdown at each log interval (one small all_gather), hands rank 0
    every rank's figures for the metrics record and the straggler detector."""

    def __init__(self, ctx: Any, model: torch.nn.Module, optimizer: Any, stragglers: StragglerConfig, *, enabled: bool = True,
                 tensorboard: str | None = None, trace: str | None = None, trace_file: str = "dtrain-trace.json",
                 first_step: int = 0, total: int | None = None) -> None:
        self.ctx = ctx
        self.optimizer = optimizer
        self.comm_bytes = comm_bytes_per_step(ctx, model)
        self.tb = TensorBoardSink(tensorboard) if tensorboard and ctx.is_main else None
        self.flops_per_sample: float | None = None
        self.peak, self.peak_name = peak_flops(ctx.device, ctx.precision.effective)
        self.bd: StepBreakdown = ctx.breakdown
        self.bd.enabled = enabled
        self.hosts = host_names(ctx.gather_object((socket.gethostname(), ctx.world.node_rank)))  # collective, once
        self.tracer: Tracer | None = None
        self.last_step = first_step
        if trace and not trace_fits(parse_steps(trace), first_step, total, is_main=ctx.is_main):
            trace = None
        if trace:
            self.tracer = Tracer(parse_steps(trace), trace_file, rank=ctx.rank, size=ctx.world_size, device=ctx.device,
                                 first_step=first_step, first_index=self.bd.steps)  # collective: measures the clock offsets
            self.bd.listeners.append(self.tracer.on_step)
        # On every rank: each one then decides alike, from the same gathered figures, when to
        # probe the links (a collective); rank 0 alone reports.
        self.detector = StragglerDetector(stragglers, self.hosts)
        if ctx.strategy.capabilities.staged_step and ctx.world.distributed and enabled and ctx.is_main:
            logger.info("stragglers are not named under a pipeline: a stage's own time is not told apart from its waits "
                        "for the other stages (the breakdown's forward, backward and comm are null there)")
        self.found: list[dict[str, Any]] = []
        self._said: set[tuple[int, str]] = set()

    def _gather(self, window: dict[str, Any] | None) -> tuple[list[dict[str, Any] | None], list[float]]:
        """Every rank's window and peak memory (MiB), in one all_gather of a few numbers."""
        peak, _ = peak_memory(self.ctx.device)
        t = torch.tensor([*pack(window), (peak or 0) / 2**20], dtype=torch.float64, device=self.ctx.device)
        rows = [g.tolist() for g in self.ctx.all_gather(t)]
        return [unpack(r[:-1]) for r in rows], [round(r[-1], 1) for r in rows]

    def count_flops(self, make_model: Any, inputs: Any, target: Any, loss_fn: Any, batch: int) -> None:
        """Count the model's FLOPs per sample once (on the meta device), for MFU."""
        flops = count_step_flops(make_model, inputs, target, loss_fn)
        self.flops_per_sample = flops / batch if flops else None

    def interval(self, step: int, samples_per_s: float | None = None) -> dict[str, Any]:
        """Fields for this log interval's record: ``breakdown`` (per rank: median and p90 ms of
        each phase), and ``stragglers`` when some were named. Collective: call on every rank."""
        record: dict[str, Any] = {"lr": self.optimizer.param_groups[0]["lr"], "comm_bytes_per_step": self.comm_bytes,
                                  **utilisation(self.flops_per_sample, samples_per_s, self.peak, self.ctx.world_size)}
        if not self.bd.enabled:
            return record
        per_rank, peak = self._gather(self.bd.window())
        found = self.detector.add(step, per_rank)
        links = None
        if self.detector.probe_due is not None:
            found, links = self._probe_links()
        if not self.ctx.is_main:
            return record
        record.update(breakdown=per_rank, peak_mib=peak)
        if links is not None:
            record["link_probe"] = links
        for s in found:
            if (s["rank"], s["cause"]) not in self._said:  # one line per straggler and cause; every one recorded
                self._said.add((s["rank"], s["cause"]))
                logger.warning(s["line"])
        if found:
            self.found.extend(found)
            record["stragglers"] = found
        return record

    def _probe_links(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Time transfers between the ranks: the ranks of a host whose link is slow, and the
        probe's figures for the record (``ms[src][dst]``). Collective: call on every rank."""
        nbytes = payload_bytes(self.comm_bytes)
        t0 = time.perf_counter()
        ms = probe(self.ctx.rank, self.ctx.world_size, self.ctx.device, nbytes)
        took = (time.perf_counter() - t0) * 1e3
        found = self.detector.name_links(ms, nbytes)
        return found, {"bytes": nbytes, "took_ms": round(took, 1), "ms": [[None if math.isnan(v) else round(v, 3) for v in row] for row in ms]}

    def result(self, samples_per_s: float | None) -> dict[str, Any]:
        """MFU, ``breakdown`` over the whole run per rank, and every straggler named. Collective."""
        use = utilisation(self.flops_per_sample, samples_per_s, self.peak, self.ctx.world_size)
        if self.ctx.is_main and use["achieved_tflops"] is not None:
            mfu = (f"MFU {use['mfu']:.1%} of {self.ctx.world_size} x {self.peak_name} peak {self.peak / 1e12:g} TFLOP/s" if self.peak
                   else f"MFU unknown: no peak FLOP/s known for {self.ctx.device.type}")
            logger.info(f"compute: {self.flops_per_sample / 1e9:.4g} GFLOP per sample (forward+backward), "
                        f"achieved {use['achieved_tflops'] * 1e3:.4g} GFLOP/s over all ranks; {mfu}")
        if self.tracer is not None and not self.tracer.done:  # the run ended inside the traced steps
            self._write_trace()
        out = {"flops_per_sample": self.flops_per_sample, **use, "breakdown": None, "stragglers": []}
        if self.bd.enabled:
            out["breakdown"], _ = self._gather(self.bd.summary())
            out["stragglers"] = self.found
        return out

    def tick(self, step: int) -> None:
        """After each step: writes the trace once its steps are done. Collective: call on every rank."""
        self.last_step = step
        if self.tracer is not None and self.tracer.due(step):
            self._write_trace()

    def _write_trace(self) -> None:
        assert self.tracer is not None
        path = self.tracer.write(self.ctx.gather_object, self.hosts)
        self.bd.listeners.remove(self.tracer.on_step)
        if path:
            last = min(self.tracer.end - 1, self.last_step)  # the run may end inside the range asked for
            logger.info(f"trace of steps {self.tracer.start} to {last} on every rank: {path} (open it in https://ui.perfetto.dev)")

    def write(self, record: dict[str, Any]) -> None:
        """Hand a metrics record to TensorBoard (rank 0, with ``--tensorboard``)."""
        if self.tb is not None:
            self.tb.write(record)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def trace_fits(steps: tuple[int, int], first_step: int, total: int | None, *, is_main: bool) -> bool:
    """Whether ``--trace START:END`` has steps in this run (``first_step`` + 1 .. ``total``):
    ConfigError when the run ends before START (every rank raises it alike); a warning when it
    resumed past START (nothing traced) or ends before END - 1 (fewer steps traced)."""
    start, end = steps
    if total is not None and start > total:
        raise ConfigError(f"--trace {start}:{end}: the run has {total} steps, so nothing would be traced; "
                          f"pick steps inside 1..{total} (e.g. --trace {max(1, total - 1)}:{total + 1}).")
    if start <= first_step:
        if is_main:
            logger.warning(f"--trace {start}:{end}: this run resumed at step {first_step}, after step {start}; "
                           "nothing is traced (pick steps after the resume).")
        return False
    if total is not None and end - 1 > total and is_main:
        logger.warning(f"--trace {start}:{end}: the run ends at step {total}; the trace holds steps {start} to {total}.")
    return True


def host_names(per_rank: list[tuple[str, int]]) -> list[str]:
    """Each rank's host for reports: its hostname, with ``/node<k>`` added where nodes share a
    hostname (containers, network namespaces), so a host stays one node."""
    names = {host for host, _ in per_rank}
    nodes = {node for _, node in per_rank}
    return [host if len(names) >= len(nodes) else f"{host}/node{node}" for host, node in per_rank]


def comm_bytes_per_step(ctx: Any, model: torch.nn.Module) -> float | None:
    """Bytes one rank hands to gradient communication per synchronised step: the strategy's count
    (``Strategy.comm_payload_bytes``: every trainable gradient by default, DDP's all-reduce; zero1's
    and fsdp's their own); 0 with one process; None when unknown."""
    if not ctx.world.distributed:
        return 0.0
    value = ctx.strategy.comm_payload_bytes(ctx.unwrap(model))
    return None if value is None else float(value)
