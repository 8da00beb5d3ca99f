"""``dtrain train --parallel auto --nnodes N``: node 0's pick, handed to every node through the
rendezvous store (docs/plan.md), since nodes planning on their own could pick different layouts
and hang in their first collective. An elastic job plans once, for MAX nodes, and keeps that pick.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

from ..errors import ConfigError, LaunchError
from .preflight import connect_store, wait_for_master
from .spec import LaunchSpec

POLL_S = 0.1


def key(run_id: str) -> str:
    return f"dtrain/auto_pick/{run_id}"


@dataclasses.dataclass(frozen=True)
class Pick:
    """What every node trains (``--strategy``, ``--parallel``), and the world the plan was made for."""

    strategy: str
    layout: str | None
    nnodes: int
    nproc: int

    @property
    def label(self) -> str:
        return self.layout or self.strategy

    def world(self) -> str:
        return f"{self.nnodes} nodes x {self.nproc} process{'es' if self.nproc > 1 else ''} (world {self.nnodes * self.nproc})"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Pick:
        return cls(**json.loads(text))


def plans_here(spec: LaunchSpec) -> bool:
    """Whether this node plans: node 0, or in an elastic job the node that will host the rendezvous."""
    if spec.elastic:
        from .runner import _can_bind

        return _can_bind(spec.addr, spec.port)
    return spec.node_rank == 0


def planned_nodes(spec: LaunchSpec) -> int:
    """The nodes the plan is for: the job's, or MAX of an elastic job's MIN:MAX."""
    return spec.max_nodes or spec.nnodes


def post(spec: LaunchSpec, cfg: Any) -> LaunchSpec:
    """``spec`` with node 0's pick (``cfg`` as the plan resolved it) among the values its store opens with."""
    if planned_nodes(spec) == 1:
        return spec
    if spec.elastic and not plans_here(spec):  # two launchers on one host: the other one hosts now, with its own pick
        raise ConfigError(f"another node began hosting the rendezvous at {spec.addr}:{spec.port} while this one planned "
                          "--parallel auto; start the other nodes once the first one (at --master-addr) listens.")
    pick = Pick(strategy=cfg.parallel.strategy, layout=cfg.parallel.layout, nnodes=planned_nodes(spec), nproc=spec.nproc)
    return dataclasses.replace(spec, store_values=(*spec.store_values, (key(spec.rdzv_id), pick.to_json())))


def wait_for_pick(store: Any, run_id: str, *, timeout_s: float, where: str, planner: str = "node 0") -> Pick:
    """The pick posted under ``run_id`` in ``store``; one line (ConfigError) if none comes within ``timeout_s``."""
    name = key(run_id)
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([name]):
            if time.monotonic() >= deadline:
                raise ConfigError(f"{planner}'s rendezvous store at {where} holds no --parallel auto pick after {timeout_s:g} s "
                                  f"(key {name}); start {planner} with --parallel auto too (it plans for every node), or give "
                                  "every node the same --strategy/--parallel.")
            time.sleep(POLL_S)
        return Pick.from_json(store.get(name))
    except (RuntimeError, ValueError):  # the store closed: its launcher ended (started without --parallel auto, or it failed)
        raise LaunchError(f"{planner}'s rendezvous store at {where} closed before it held a --parallel auto pick; see "
                          f"{planner}'s output, and start every node with --parallel auto.") from None


def receive(cfg: Any, spec: LaunchSpec) -> Any:
    """``cfg`` with node 0's pick, read from its rendezvous store (a node other than 0)."""
    where, planner = f"{spec.addr}:{spec.port}", "the first node" if spec.elastic else "node 0"
    me = "this node" if spec.elastic else f"node {spec.node_rank}"
    wait_for_master(spec.addr, spec.port, timeout_s=spec.startup_timeout, me=me, what=planner,
                    waiting=f"{planner} may still be planning (--parallel auto profiles the model first), or not started")
    store = connect_store(spec.addr, spec.port)
    try:
        pick = wait_for_pick(store, spec.rdzv_id, timeout_s=spec.startup_timeout, where=where, planner=planner)
    finally:
        del store
    if (pick.nnodes, pick.nproc) != (planned_nodes(spec), spec.nproc):
        nodes = f"{spec.nnodes}:{spec.max_nodes}" if spec.elastic else spec.nnodes
        raise ConfigError(f"{planner} planned --parallel auto for {pick.world()}, but this node was started with --nnodes "
                          f"{nodes} -n {spec.nproc}; start every node with the same --nnodes and -n.")
    kept = "; kept at every size the job runs at" if spec.elastic else ""
    print(f"dtrain: --parallel auto: {planner}'s pick for {pick.world()}: {pick.label}{kept}; {me} trains it.",
          file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=pick.strategy, layout=pick.layout))
