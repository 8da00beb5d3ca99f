"""The full training state, saved and restored: what a resume needs to continue bit for bit
(docs/checkpoints.md). Besides the objects given: the grad scaler, and per rank the strategy's
communication state and the RNG states, which go back to the same rank on the same world size.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from .. import _check as check
from .._log import logger
from ..errors import CheckpointError, first_line
from . import lock
from .sharded import SHARDED_DIR, load_sharded, save_sharded, sharded_names
from .store import STATE_FILE, clean_leftovers, prune, set_latest, step_name, write_checkpoint
from .validate import newest_valid, read_checkpoint, state_problem

if TYPE_CHECKING:
    from ..comm.collectives import Collectives
    from ..strategies.base import Strategy


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds besides the objects given, and the collectives it is saved and
    loaded with; ``seed`` re-seeds the RNGs on another world size."""

    collectives: Collectives
    strategy: Strategy
    scaler: torch.amp.GradScaler | None = None
    seed: int = 0


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"state": torch.from_numpy(np_state["state"]["key"].astype(np.int64)), "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": n["state"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_cpu(obj: Any, pool: Any = None) -> Any:
    """A copy whose tensors live in CPU memory, reusing ``pool``'s tensors (the previous snapshot)
    where they fit: memory already mapped copies several times faster than fresh pages."""
    if torch.is_tensor(obj):
        if torch.is_tensor(pool) and pool.shape == obj.shape and pool.dtype == obj.dtype and pool.device.type == "cpu":
            return pool.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = pool if isinstance(pool, dict) else {}
        return {k: _to_cpu(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = pool if isinstance(pool, (list, tuple)) and len(pool) == len(obj) else [None] * len(obj)
        return type(obj)(_to_cpu(v, q) for v, q in zip(obj, old))
    return obj


def _state_of(obj: Any) -> Any:
    original = getattr(obj, "original", None)  # DtrainModule: the user's module, no wrapper prefixes
    if isinstance(original, nn.Module):
        return original.state_dict()
    return obj.state_dict()


class CheckpointManager:
    """Checkpoints of one run in ``folder``, ``keep`` of them. Collective: every rank creates it
    (rank 0 takes the folder's lock, so a second job stops here), ``save``s and ``resume``s.
    ``async_save``: rank 0 copies the state to host memory (kept for the next save) and writes it
    in a background thread; ``last_blocking_s`` tells how long the loop was held."""

    def __init__(self, run: RunState, folder: str, *, keep: int = 3, async_save: bool = False) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}; at least the latest checkpoint is kept.")
        check.instance("CheckpointManager(async_save=...)", async_save, bool, "give True or False")  # 'no' would be true
        self.run = run
        coll = run.collectives
        self.folder = folder
        self.keep = keep
        self.async_save = async_save
        self.last_blocking_s: float | None = None
        self.last_total_s: float | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cleaned = False
        self._pool: Any = None  # the last asynchronous snapshot, whose host memory the next one reuses
        self._lock: str | None = None
        problem = None
        if coll.is_main:
            try:
                self._lock = lock.acquire(folder)
            except CheckpointError as exc:
                problem = str(exc)
        problem = coll.broadcast_object(problem)  # every rank stops with the same line
        if problem is not None:
            raise CheckpointError(problem)

    def close(self) -> None:
        """Finish a background save and give the folder's lock back. Idempotent."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._lock is not None:
            lock.release(self._lock)
            self._lock = None

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, *, extra: dict[str, Any] | None = None, **objects: Any) -> str:
        """Save the full training state as checkpoint ``step``; returns its path. Collective."""
        t0 = time.perf_counter()
        run, coll = self.run, self.run.collectives
        coll.tracker.beat()
        self.wait()
        # Per-rank parts, gathered on rank 0: RNG streams and the strategy's communication state
        # (e.g. error-feedback residuals differ between ranks).
        per_rank = coll.gather_object({"rng": rng_state(), "comm": run.strategy.state_dict()}, dst=0)
        path = os.path.join(self.folder, step_name(step))
        if coll.is_main and not self._cleaned:
            clean_leftovers(self.folder)  # of a save killed midway by an earlier process
            self._cleaned = True
        run.strategy.prepare_checkpoint(objects)  # zero1: gather optimizer state on rank 0
        sharded: list[str] = []
        staging = os.path.join(self.folder, f".tmp-{step_name(step)}-sharded")
        if run.strategy.capabilities.sharded_state:  # fsdp, hsdp, pipeline: every rank writes its part
            sharded = save_sharded(coll, staging, objects)
        if coll.is_main:
            state = {"objects": {k: _state_of(v) for k, v in objects.items() if v is not None and k not in sharded},
                     "extra": dict(extra or {}), "step": step, "world_size": coll.world_size,
                     "rng": [r["rng"] for r in per_rank], "sharded": sharded}
            if run.scaler is not None:
                state["grad_scaler"] = run.scaler.state_dict()
            if any(r["comm"] is not None for r in per_rank):
                state["comm"] = [r["comm"] for r in per_rank]
            meta = {"world_size": coll.world_size, "time": time.time(), "objects": sorted([*state["objects"], *sharded]),
                    "sharded": sharded}
            staged = {SHARDED_DIR: staging} if sharded else {}
            if self.async_save:
                snapshot = self._pool = _to_cpu(state, self._pool)
                self.last_blocking_s = time.perf_counter() - t0
                self._thread = threading.Thread(target=self._write, args=(step, snapshot, meta, t0, staged), daemon=False)
                self._thread.start()
            else:
                self._write(step, state, meta, t0, staged)
                self.last_blocking_s = time.perf_counter() - t0
                self.wait()  # a failed write raises here, on rank 0
        if not self.async_save:
            coll.barrier()  # nobody moves on before the checkpoint is complete
        return path

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any], t0: float, staged: dict[str, str]) -> None:
        try:
            path = write_checkpoint(self.folder, step, {STATE_FILE: state}, meta, staged=staged)
            set_latest(self.folder, path)
            prune(self.folder, self.keep)
            self.last_total_s = time.perf_counter() - t0
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def wait(self) -> None:
        """Wait for a background save to finish; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- loading --------------------------------------------------------------------------------
    def latest_valid(self) -> str | None:
        """The newest checkpoint that passes its checksums (``latest`` first), corrupt ones skipped
        with a warning; None when there is none, a CheckpointError when none is valid."""
        path, problems = newest_valid(self.folder)
        if path is not None:
            return path
        if problems:
            raise CheckpointError(
                f"{self.folder} holds {len(problems)} checkpoint(s) and none is valid (newest: {problems[0]}); "
                f"check them with `dtrain ckpt verify {self.folder}`, or use another folder to start afresh."
            )
        return None

    def resume(self, *, path: str | None = None, **objects: Any) -> dict[str, Any] | None:
        """Restore the newest valid checkpoint (or ``path``) into ``objects``; returns
        ``{"step", "extra", "path", "world_size"}``, or None when there is none. Collective:
        rank 0 picks the checkpoint so every rank loads the same."""
        if path is None:
            found: tuple[str | None, str | None] = (None, None)
            if self.run.collectives.is_main:
                try:
                    found = (self.latest_valid(), None)
                except CheckpointError as exc:
                    found = (None, str(exc))
            path, problem = self.run.collectives.broadcast_object(found)
            if problem is not None:
                raise CheckpointError(problem)
        if path is None:
            return None
        return load_into(self.run, path, objects)


def load_into(run: RunState, path: str, objects: dict[str, Any]) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``objects`` (and ``run``'s scaler, strategy, RNG). Collective."""
    state = read_checkpoint(path, map_location="cpu")  # verified first; weights_only=True
    problem = state_problem(state)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}.")
    stored, sharded = state["objects"], state.get("sharded") or []
    if not sharded and run.strategy.capabilities.sharded_state:
        wanted = sharded_names({k: v for k, v in objects.items() if v is not None})
        if wanted:
            raise CheckpointError(f"checkpoint {path} is a full-state checkpoint (one file), but strategy {run.strategy.name!r} "
                                  "loads sharded ones; resume it with the strategy that saved it (e.g. ddp), or load its "
                                  "model weights before ctx.setup.")
    for name, obj in objects.items():
        if obj is None or name in sharded:
            continue
        if name not in stored:
            raise CheckpointError(f"checkpoint {path} has no {name!r} (it holds: {', '.join(sorted([*stored, *sharded]))}).")
        _load_one(path, name, obj, stored[name])
    if sharded:
        load_sharded(run.collectives, path, objects, sharded)
    try:
        _load_rest(run, path, state)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:  # a state.pt of wrong types
        raise CheckpointError(f"checkpoint {path}: its grad scaler, communication or RNG state is malformed "
                              f"({type(exc).__name__}: {str(exc).strip()[:120]}).") from None
    return {"step": int(state["step"]), "extra": state.get("extra", {}), "path": path, "world_size": state.get("world_size")}


def _load_rest(run: RunState, path: str, state: dict[str, Any]) -> None:
    rank = run.collectives.rank
    if run.scaler is not None and "grad_scaler" in state:
        run.scaler.load_state_dict(state["grad_scaler"])
    same_world = state.get("world_size") == run.collectives.world_size
    _load_comm(run, path, state.get("comm"), same_world)
    rngs = state.get("rng") or []
    if same_world and rank < len(rngs):
        set_rng_state(rngs[rank])
    else:
        # Another world size: no rank's stream can continue; start fresh, distinct streams.
        seed = (run.seed + 1000003 * int(state["step"]) + rank) % 2**31
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def _load_comm(run: RunState, path: str, comm: list[Any] | None, same_world: bool) -> None:
    """Give each rank its own communication state back; on another world size it cannot be
    mapped to the new ranks, so the strategy starts its state afresh."""
    coll = run.collectives
    if comm is None:
        return
    if same_world and coll.rank < len(comm):
        if comm[coll.rank] is not None:
            run.strategy.load_state_dict(comm[coll.rank])
    elif coll.is_main:
        logger.warning(f"checkpoint {path}: the communication state of {len(comm)} rank(s) does not map onto "
                       f"{coll.world_size}; strategy {run.strategy.name!r} starts it afresh.")


def _load_one(path: str, name: str, obj: Any, sd: Any) -> None:
    target = getattr(obj, "original", obj)
    if isinstance(target, nn.Module):
        ours = target.state_dict()
        missing = sorted(set(ours) - set(sd))
        unexpected = sorted(set(sd) - set(ours))
        shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(ours[k].shape)}" for k in ours
                  if k in sd and torch.is_tensor(sd[k]) and sd[k].shape != ours[k].shape]
        if missing or unexpected or shapes:
            parts = []
            if missing:
                parts.append(f"missing {_few(missing)}")
            if unexpected:
                parts.append(f"unexpected {_few(unexpected)}")
            if shapes:
                parts.append(f"shape mismatch {_few(shapes)} (checkpoint vs model)")
            raise CheckpointError(f"checkpoint {path} does not fit this {name}: {'; '.join(parts)}.")
    try:
        target.load_state_dict(sd)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this {name}: {first_line(exc)}.") from None


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
