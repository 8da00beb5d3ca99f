"""``--launcher ray``: the workers of ``dtrain run`` / ``dtrain train`` placed by a Ray cluster
(docs/ray.md): one actor per rank in a placement group of one bundle per node, each starting the
worker command of dtrain's own launcher. A lost rank: every actor is killed and a new set started,
up to ``--max-restarts`` times. Ray is imported only when a job uses it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError, LaunchError
from ..options import LAUNCH_DIR_ENV
from ..world.netif import is_loopback
from .local import worker_env
from .ray_rank import FUNCTION_ENTRY, RankActor
from .runner import _report_failure
from .spec import LaunchSpec
from .supervise import GRACE_S

INSTALL_HINT = "pip install 'dtrain[ray]'"
#: Variables of the driver's environment its workers get too (an actor starts from the raylet's).
FORWARD_PREFIXES = ("DTRAIN_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "OMP_", "MKL_")
FORWARD_NAMES = ("PYTHONPATH",)
_POLL_S = 0.5


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--launcher ray needs the ray package, which is not installed here; {INSTALL_HINT} "
                          "(or pip install 'ray>=2.9').") from None
    return ray


def launch_script(spec: LaunchSpec, script: str, argv: list[str]) -> int:
    """``dtrain run --launcher ray``: every rank runs ``python -m dtrain.launch.worker SCRIPT ARGV``."""
    return _launch(spec, ["-u", "-m", "dtrain.launch.worker", os.path.abspath(script), *argv], None)


def launch_function(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> int:
    """``dtrain train --launcher ray``: every rank runs ``fn(*args)`` (pickled, by reference)."""
    return _launch(spec, ["-u", "-m", FUNCTION_ENTRY], pickle.dumps((fn, args)))


def _launch(spec: LaunchSpec, command: list[str], call: bytes | None) -> int:
    ray = import_ray()
    with connected(ray, spec.ray_address), _placement(ray, spec) as (pg, gpus):
        return _Job(ray, spec, pg, gpus, command, call).run()


@contextlib.contextmanager
def connected(ray: Any, address: str | None) -> Iterator[None]:
    """Connect this process to the cluster at ``address`` (None: ``RAY_ADDRESS``, else a cluster
    running on this machine; ``local``: start one for this job); disconnect after."""
    if ray.is_initialized():  # a driver that connected already (dtrain.ray, a notebook)
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    where = "a Ray cluster on this machine (none given: --ray-address, RAY_ADDRESS)" if address == "auto" else f"--ray-address {address}"
    _check_reachable(address)
    import logging

    own = {"include_dashboard": False} if address == "local" else {}  # options Ray refuses for a cluster that runs already
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **own)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(f"no Ray cluster reachable at {where}: {why}; start one (`ray start --head`), give its "
                          "address (--ray-address HOST:6379), or --ray-address local for a cluster of this machine alone. "
                          "A cluster that uses token authentication also needs RAY_AUTH_MODE=token here.") from None
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """A HOST:PORT nobody listens on fails in a second here (Ray's own connect retries for ~40 s)."""
    if address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--ray-address {address} is not HOST:PORT (the head's GCS port, 6379 by default), ray://HOST:PORT, "
                          "auto or local; e.g. --ray-address 10.0.0.1:6379.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        # A head whose host name resolves to 127.0.0.1 listens on loopback only.
        loopback = "" if is_loopback(host.strip("[]")) else (
            f" (a head that printed 'Local node IP: 127.0.0.1' listens on loopback only: start it with "
            f"`ray start --head --node-ip-address {host}`)")
        raise ConfigError(f"no Ray cluster reachable at --ray-address {address} ({exc.strerror or exc}); start its head "
                          f"(`ray start --head --port {port}`) or give the address `ray start --head` printed{loopback}.") from None


@contextlib.contextmanager
def _placement(ray: Any, spec: LaunchSpec) -> Iterator[tuple[Any, bool]]:
    """A placement group of one bundle per node, ready (or one ConfigError line saying why not)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    # One GPU per rank where the cluster has GPUs, unless told to see none (CUDA_VISIBLE_DEVICES=: the CPU).
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    bundle = {"CPU": float(spec.nproc), **({"GPU": float(spec.nproc)} if gpus else {})}
    _check_capacity(ray, spec, bundle)
    pg = placement_group([dict(bundle) for _ in range(spec.nnodes)], strategy="STRICT_SPREAD" if spec.nnodes > 1 else "PACK")
    try:
        ready = pg.wait(timeout_seconds=spec.startup_timeout)
        if not ready:
            avail = ray.available_resources()
            free = ", ".join(f"{avail.get(k, 0):g} {k}" for k in ("CPU", "GPU") if k in avail or k == "CPU")
            raise ConfigError(f"the Ray cluster could not place {_ask(spec, bundle)} within --startup-timeout "
                              f"{spec.startup_timeout:g} s (free now: {free}); other jobs hold its resources: wait for them, or ask for fewer.")
        yield pg, gpus
    finally:
        remove_placement_group(pg)


def _check_capacity(ray: Any, spec: LaunchSpec, bundle: dict[str, float]) -> None:
    """More than the cluster has, in all or per node: one line now, not a placement that never comes."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    fit = [r for r in nodes if all(r.get(k, 0) >= v for k, v in bundle.items())]
    if len(fit) >= spec.nnodes:
        return
    kind = "GPU" if "GPU" in bundle else "CPU"
    have = ", ".join(f"{r.get(kind, 0):g}" for r in nodes) or "none"
    fix = (f"use -n {int(max((r.get(kind, 0) for r in nodes), default=0))} or fewer" if spec.nnodes == 1 else
           f"use --nnodes {len(fit)} or a smaller -n")
    raise ConfigError(f"the Ray cluster cannot place {_ask(spec, bundle)}: it has {len(nodes)} node(s) with {have} "
                      f"{kind}(s) each; {fix}, or add nodes to the cluster.")


def _ask(spec: LaunchSpec, bundle: dict[str, float]) -> str:
    per = " and ".join(f"{int(v)} {k}(s)" for k, v in bundle.items())
    return f"-n {spec.nproc} worker(s) on each of {spec.nnodes} node(s) ({per} per node)"


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES) and k not in ("DTRAIN_LAUNCHER_PID", LAUNCH_DIR_ENV)}


class _Job:
    """The attempts of one job: a set of actors, watched until every worker ends; again after a lost rank."""

    def __init__(self, ray: Any, spec: LaunchSpec, pg: Any, gpus: bool, command: list[str], call: bytes | None) -> None:
        self.ray, self.spec, self.pg, self.gpus = ray, spec, pg, gpus
        self.command, self.call = command, call
        self.run_id = f"ray-{uuid.uuid4().hex[:8]}"
        self.signum = 0
        self.errors: list[dict[str, Any]] = []

    def run(self) -> int:
        with self._signals():
            for attempt in range(self.spec.max_restarts + 1):
                codes = self._attempt(attempt)
                if self.signum:  # told to stop: the workers saved and ended (or were killed after the grace)
                    return self._stopped()
                if len(codes) == self.spec.world_size and all(c == 0 for c in codes.values()):
                    return 0
                failed = {r: c for r, c in codes.items() if c != 0}
                # The cause: a rank killed or lost (its peers then fail in a collective), else the lowest that exited.
                rank = min(failed, key=lambda r: (failed[r] is not None and failed[r] > 0, r))
                first = self.first_error()
                if attempt == self.spec.max_restarts or (first is not None and first["user_error"]):
                    break
                if first is not None:  # what failed, once, before the restart (the final report shows the last one)
                    print(f"dtrain: worker rank {first['rank']} raised:\n{first['text']}", file=sys.stderr, flush=True)
                print(f"dtrain: worker rank {rank} {_ended(failed[rank])}; restarting all {self.spec.world_size} workers "
                      f"from the last checkpoint (restart {attempt + 1} of {self.spec.max_restarts}).", file=sys.stderr, flush=True)
                self.errors.clear()
        if failed[rank] is None or failed[rank] < 0:
            print(f"dtrain: error: worker rank {rank} {_ended(failed[rank])}; see its output above"
                  f"{' and the Ray logs of its node' if failed[rank] is None else ''}.", file=sys.stderr, flush=True)
            return 1
        return _report_failure(failed, self)

    def first_error(self) -> dict[str, Any] | None:
        """The earliest error a worker reported (runner's failure report reads it)."""
        return min(self.errors, key=lambda r: r.get("time", 0.0)) if self.errors else None

    def _attempt(self, attempt: int) -> dict[int, int | None]:
        """Start every rank, watch them until all ended or one failed; each rank's exit status (None: lost)."""
        actors = self._actors()
        try:
            ranks = self._start(actors, attempt)
            return self._watch(ranks)
        except self.ray.exceptions.GetTimeoutError:
            raise LaunchError(f"the Ray actors of this job did not start within --startup-timeout {self.spec.startup_timeout:g} s; "
                              "see `ray status` and the Ray logs of the cluster.") from None
        finally:
            # Each actor kills its worker and removes its folder; the kill below ends a lost actor's.
            with contextlib.suppress(Exception):
                self.ray.get([a.close.remote() for a in actors], timeout=10)
            for actor in actors:
                self.ray.kill(actor, no_restart=True)  # its worker dies with it (PR_SET_PDEATHSIG)

    def _actors(self) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self.ray.remote(RankActor)
        return [remote.options(num_cpus=1, num_gpus=1 if self.gpus else 0, max_restarts=0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node)).remote()
                for node in range(self.spec.nnodes) for _ in range(self.spec.nproc)]

    def _start(self, actors: list[Any], attempt: int) -> dict[int, Any]:
        """Number the ranks (node = bundle; within a node, by GPU), host the store on rank 0's
        node, start the workers; returns rank -> actor."""
        spec = self.spec
        places = self.ray.get([a.place.remote() for a in actors], timeout=spec.startup_timeout)
        ranks: dict[int, Any] = {}
        node_gpus: dict[int, str] = {}
        for node in range(spec.nnodes):
            mine = sorted(range(node * spec.nproc, (node + 1) * spec.nproc), key=lambda i: (places[i]["gpus"], i))
            node_gpus[node] = ",".join(g for i in mine for g in places[i]["gpus"])
            ranks.update({node * spec.nproc + local: actors[i] for local, i in enumerate(mine)})
        addr = places[actors.index(ranks[0])]["ip"]
        port = self.ray.get(ranks[0].host_store.remote(addr), timeout=spec.startup_timeout)
        base = _forwarded_env()
        if spec.nproc > 1:
            base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's rule, as dtrain's own launcher
        # As torch's agent tells its workers: which attempt this is (dtrain train resumes after 0).
        agent = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                 "TORCHELASTIC_RUN_ID": self.run_id}
        started = []
        for rank, actor in ranks.items():
            node, local = divmod(rank, spec.nproc)
            env = {**base, **worker_env(rank, local, spec.world_size, spec.nproc, node, addr, port), **agent,
                   **({"CUDA_VISIBLE_DEVICES": node_gpus[node]} if self.gpus else {})}
            started.append(actor.start.remote(self.command, env, os.getcwd(), self.call))
        self.ray.get(started, timeout=spec.startup_timeout)
        return ranks

    def _watch(self, ranks: dict[int, Any]) -> dict[int, int | None]:
        codes: dict[int, int | None] = {}
        stop_at = None
        while len(codes) < len(ranks):
            running = {r: a for r, a in ranks.items() if r not in codes}
            refs = {r: a.poll.remote(_POLL_S) for r, a in running.items()}
            for rank, ref in refs.items():
                try:
                    got = self.ray.get(ref)
                except self.ray.exceptions.RayActorError:
                    codes[rank] = None  # the actor (or its node) is gone
                    continue
                for data, stream in ((got["err"], sys.stderr), (got["out"], sys.stdout)):
                    if data:
                        stream.flush()
                        stream.buffer.write(data)
                        stream.buffer.flush()
                if got["code"] is not None:
                    codes[rank] = got["code"]
                    self.errors.extend(got["errors"])
            if any(c != 0 for c in codes.values()) and not self.signum:
                break  # one rank failed: its peers wait in a collective for it; end them all (as torch's agent does)
            if self.signum and stop_at is None:
                stop_at = time.monotonic() + GRACE_S[self.signum]
                for actor in running.values():
                    actor.signal.remote(self.signum)
            if stop_at is not None and time.monotonic() > stop_at:
                break
        return codes

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Stop signals are forwarded to every worker, which gets GRACE_S to end before its actor is killed."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: object) -> None:
            if not self.signum:
                self.signum = signum

        previous = {sig: signal.signal(sig, on_signal) for sig in GRACE_S}
        try:
            yield
        finally:
            for sig, prev in previous.items():
                signal.signal(sig, prev)

    def _stopped(self) -> int:
        print(f"dtrain: stopped by {signal.Signals(self.signum).name}.", file=sys.stderr, flush=True)
        return 128 + self.signum


def _ended(code: int | None) -> str:
    if code is None:
        return "was lost (its Ray actor or node died)"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def check_launch(spec: LaunchSpec) -> None:
    """What --launcher ray cannot take with it, and ray itself: one line before anything starts."""
    if spec.max_nodes is not None:
        raise ConfigError("--nnodes MIN:MAX does not go with --launcher ray; Ray places a fixed set of nodes (--nnodes N).")
    if spec.node_rank != 0 or spec.master_addr or spec.master_port is not None or spec.local_addr:
        raise ConfigError("--node-rank, --master-addr, --master-port and --local-addr do not go with --launcher ray: Ray places "
                          "the nodes and rank 0's actor picks the rendezvous address; run the command once, leave them out.")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"--launcher ray needs the ray package, which is not installed here; {INSTALL_HINT}.")


__all__ = ["check_launch", "connected", "import_ray", "launch_function", "launch_script"]
