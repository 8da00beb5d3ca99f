"""The methods behind ``--comm``: torch's DDP comm hooks and model averager, each with
``communicate(bucket)``, ``after_step(optimizer)`` and a state dict split into ``shared`` (equal on
every rank) and ``local`` (e.g. PowerSGD's error feedback), so a resume on another world size
keeps what still applies.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.utils._pytree import tree_map

Future = torch.futures.Future


def allreduce(bucket: dist.GradBucket) -> Future:
    """Plain all-reduce of the bucket, averaged over ranks (DDP's own behaviour)."""
    return default_hooks._allreduce_fut(dist.group.WORLD, bucket.buffer())


class AllReduce:
    """All-reduce every step: plain (``none``), or in 16 bits (``fp16``/``bf16``, torch's compress
    hooks): half the bytes; bf16 keeps fp32's range, fp16 keeps 3 more mantissa bits."""

    def __init__(self, kind: str = "none") -> None:
        self.kind = kind
        hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        self._hook = hooks.get(kind, lambda _, bucket: allreduce(bucket))
        self.steps = 0

    def communicate(self, bucket: dist.GradBucket) -> Future:
        if bucket.is_last():
            self.steps += 1
        return self._hook(None, bucket)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"shared": {"steps": self.steps}, "local": {}}

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        self.steps = int(state["shared"]["steps"])


class PowerSGD:
    """torch's per-layer PowerSGD hook (Vogels et al., 2019) with error feedback and warm start,
    after ``warmup`` plain steps. Needs ONE DDP bucket (``bucket_mb``): on gloo the hook fails
    ("Received data size doesn't match expected size") with several."""

    def __init__(self, rank: int, warmup: int) -> None:
        self.state = PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, warmup),
            use_error_feedback=True, warm_start=True, random_seed=0,
            compression_stats_logging_frequency=2**31 - 1,
        )
        self._fresh_ddp = True

    def communicate(self, bucket: dist.GradBucket) -> Future:
        if self._fresh_ddp and self.state.iter >= self.state.start_powerSGD_iter:
            # Resumed into a new DDP: its first step still has the initial bucket layout (DDP
            # rebuilds buckets after it), which P/Q memory and error feedback do not match.
            # Plain all-reduce for that step, leaving the compression state as it was.
            self._fresh_ddp = not bucket.is_last()
            return allreduce(bucket)
        self._fresh_ddp = False
        return powerSGD_hook(self.state, bucket)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        _, key, pos, has_gauss, gauss = s.rng.get_state()
        return {
            "shared": {
                "iter": s.iter, "rank": s.matrix_approximation_rank,
                "rng": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
                # With warm start, P and Q are all-reduced results: the same on every rank.
                "p_memory": _clone(s.p_memory_dict), "q_memory": _clone(s.q_memory_dict),
                "numel_before": s.total_numel_before_compression, "numel_after": s.total_numel_after_compression,
            },
            "local": {"error": _clone(s.error_dict)},
        }

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        s, shared = self.state, state["shared"]
        s.iter = int(shared["iter"])
        rng = shared["rng"]
        s.rng.set_state(("MT19937", rng["key"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["gauss"]))
        s.p_memory_dict = _clone(shared["p_memory"])
        s.q_memory_dict = _clone(shared["q_memory"])
        s.total_numel_before_compression = int(shared["numel_before"])
        s.total_numel_after_compression = int(shared["numel_after"])
        # Error feedback is what this rank's compression left out; another rank's is no use.
        s.error_dict = _clone(state["local"]["error"]) if same_ranks else {}


def powersgd_numel(shapes: list[torch.Size], rank: int) -> tuple[int, int]:
    """Elements PowerSGD sends per step for gradients of these shapes: (compressed P+Q, uncompressed).
    The same rule as torch's hook (``_should_compress`` with min_compression_rate 2)."""
    compressed = plain = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = max(1, int(torch.Size(shape).numel()) // max(n, 1))
        r = min(n, m, rank)
        worth, full, small = _should_compress(n, m, r, 2)
        if worth and len(shape) > 1:
            compressed += small
        else:
            plain += full
    return compressed, plain


class LocalSGD:
    """Post-local SGD (Lin et al., 2020): ``warmup`` plain steps, then local steps with parameters
    averaged every ``period`` by torch's ``PeriodicModelAverager`` (torch's own hook needs CUDA)."""

    def __init__(self, period: int, warmup: int) -> None:
        self.period = period
        self.warmup = warmup
        self.iter = 0
        self._averagers: dict[int, PeriodicModelAverager] = {}
        self._averager_steps: list[int] = []  # loaded before the optimizers register
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending_optim: list[dict] | None = None

    def communicate(self, bucket: dist.GradBucket) -> Future:
        local = self.iter >= self.warmup
        if bucket.is_last():
            self.iter += 1
        if not local:
            return allreduce(bucket)
        fut: Future = Future()
        fut.set_result(bucket.buffer())  # this rank's own gradient
        return fut

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank, after every optimizer step."""
        averager = self._averagers.get(id(optimizer))
        if averager is None:
            with warnings.catch_warnings():  # period 1 warns "only DDP needs to be used": a test case here
                warnings.simplefilter("ignore")
                averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup)
            index = len(self._averagers)
            if index < len(self._averager_steps):
                averager.step = self._averager_steps[index]
            self._averagers[id(optimizer)] = averager
        averager.average_parameters(optimizer.param_groups)

    @property
    def steps(self) -> list[int]:
        return [a.step for a in self._averagers.values()] or list(self._averager_steps)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Between averages each rank's optimizer state (momentum, Adam's moments) is its own, so
        this rank's is kept here too: a checkpoint stores only rank 0's optimizer."""
        self._optimizers.append(optimizer)
        if self._pending_optim is not None and len(self._optimizers) <= len(self._pending_optim):
            _set_optimizer_state(optimizer, self._pending_optim[len(self._optimizers) - 1])

    def state_dict(self) -> dict[str, Any]:
        optim = [_clone_nested(o.state_dict()["state"]) for o in self._optimizers]
        return {"shared": {"iter": self.iter, "period": self.period, "averager_steps": self.steps}, "local": {"optimizers": optim}}

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        shared = state["shared"]
        self.iter = int(shared["iter"])
        self._averager_steps = [int(s) for s in shared["averager_steps"]]
        for averager, step in zip(self._averagers.values(), self._averager_steps):
            averager.step = step
        if same_ranks:  # this rank's own optimizer state replaces the copy of rank 0's
            self._pending_optim = list(state["local"].get("optimizers", []))
            for optimizer, saved in zip(self._optimizers, self._pending_optim):
                _set_optimizer_state(optimizer, saved)


def _set_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    full = optimizer.state_dict()
    full["state"] = _clone_nested(saved)
    optimizer.load_state_dict(full)


def _clone_nested(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if torch.is_tensor(t) else t, obj)


def _clone(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {int(k): v.detach().clone() for k, v in tensors.items()}


def build(kind: str, *, rank: int = 2, period: int = 16, warmup: int = 0) -> AllReduce | PowerSGD | LocalSGD:
    if kind in ("none", "fp16", "bf16"):
        return AllReduce(kind)
    if kind == "powersgd":
        return PowerSGD(rank, warmup)
    if kind == "localsgd":
        return LocalSGD(period, warmup)
    raise AssertionError(f"no method object for comm kind {kind!r}")
