"""Start the workers of one node: through torch's elastic agent (``torch.distributed.run``'s
engine) or ``torch.multiprocessing.spawn``. Nothing here re-implements either."""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .._log import logger
from ..context.preempt import REJOIN_EXIT
from ..diag.watchdog import STALL_EXIT
from ..errors import DtrainError, LaunchError
from ..options import handed_over, launch_link
from ..world import use_route_interface
from ..world.reach import advertised_address
from . import membership
from .lifecycle import run_worker
from .local import worker_env
from .preflight import check_nodes, connect_store, cuda_device_count, wait_for_master
from .spec import LaunchSpec
from .store import host_store
from .supervise import AGENT_SIGNALS, Stopped, Supervisor

#: Worker exit status that means "the worker already printed a clear error line".
USER_ERROR_EXIT = 2


def launch_function(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` in ``spec.nproc`` workers on this node; returns the exit status."""
    if spec.launcher == "ray":  # imported only here: dtrain runs without Ray
        from . import ray

        return ray.launch_function(spec, fn, *args)
    if spec.launcher == "spawn":
        return _spawn(spec, fn, args)
    return _elastic(spec, fn, args)


def launch_script(spec: LaunchSpec, script: str, argv: list[str]) -> int:
    """Run ``python script argv...`` in ``spec.nproc`` workers on this node; returns the exit status."""
    if spec.launcher == "ray":
        from . import ray

        return ray.launch_script(spec, script, argv)
    if spec.launcher == "spawn":
        return _spawn(spec, run_script, (script, argv))
    # dtrain's worker entry (not `python script.py`): the worker dies with this launcher (lifecycle.py).
    return _elastic(spec, sys.executable, ("-u", "-m", "dtrain.launch.worker", script, *argv))


def run_script(script: str, argv: list[str]) -> None:
    """Execute ``script`` as ``__main__`` with ``argv`` (how a spawned worker runs a script)."""
    from .dropin import guard_own_world, script_argv

    guard_own_world()
    sys.argv = [script, *script_argv(argv)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


@contextlib.contextmanager
def _rendezvous(spec: LaunchSpec) -> Iterator[int]:
    """Host the rendezvous store on node 0 (bound to the master address); yields its port.
    With ``--nnodes MIN:MAX`` torch's c10d rendezvous hosts its own store on the first node."""
    if spec.elastic:
        # Each round builds its workers' store afresh: torch's shared store keeps the first round's
        # rank-0 address on the other nodes, and a join after a loss then waits for keys nobody sees.
        membership.posted = spec.store_values  # the host's store opens in torch's agent (membership._c10d_backend)
        # The checkpoint lock and dtrain train's resume key on the job's `run id@endpoint` (rank 0 may move).
        run_id = f"{spec.rdzv_id}@{spec.addr}:{spec.port}"
        given = contextlib.nullcontext() if launch_link().elastic is not None else handed_over(link={"elastic": run_id})
        with given, _env_default("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"):
            yield spec.port
        return
    if spec.node_rank != 0:
        wait_for_master(spec.addr, spec.port, timeout_s=spec.startup_timeout, me=f"node {spec.node_rank}")
        check_nodes(spec, spec.port, timeout_s=spec.startup_timeout)
        try:
            yield spec.port
        finally:
            _say_done(spec)
        return
    store, port = host_store(spec.addr, spec.port)
    for key, value in spec.store_values:  # before any node's check: a node waiting for these is connected by then
        store.set(key, value)
    try:
        if spec.nnodes > 1:
            check_nodes(spec, port, timeout_s=spec.startup_timeout)  # no agent of another node waits on a failed check
        try:
            yield port
        finally:
            if spec.nnodes > 1:
                _wait_for_others(store, spec.nnodes - 1)
    finally:
        del store


#: Node 0 keeps the store until each node says it is done: closing it while their agents are in
#: torch's exit barrier gives them a "recvValueWithTimeout failed" warning with C++ frames.
_DONE_KEY = "/dtrain/done"
_DONE_WAIT_S = 15.0


def _say_done(spec: LaunchSpec) -> None:
    try:
        connect_store(spec.addr, spec.port, handshake_s=5).add(_DONE_KEY, 1)
    except (DtrainError, RuntimeError, ValueError):
        pass  # node 0 is gone already: nothing to tell


def _wait_for_others(store: Any, others: int) -> None:
    deadline = time.monotonic() + _DONE_WAIT_S
    try:
        while store.add(_DONE_KEY, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, ValueError):
        pass


def _quiet_elastic_logs() -> None:
    """The elastic agent logs each failure as a multi-line table (and torch.multiprocessing each
    worker it stops); dtrain prints one line instead."""
    if logger.isEnabledFor(logging.DEBUG):
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):  # "Terminating process" too
            logging.getLogger(name).setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _socket_interface(spec: LaunchSpec) -> Iterator[None]:
    """The workers' gloo/NCCL sockets use the interface that routes to the master (plain torchrun
    binds gloo to whatever the host name resolves to, often 127.0.0.1); with CUDA each worker
    judges its own backend's variable (``dtrain.init``)."""
    backend = None if cuda_device_count() else "gloo"
    chosen = use_route_interface(spec.addr, quiet=spec.node_rank != 0, backend=backend)
    try:
        yield
    finally:
        for key in chosen:
            os.environ.pop(key, None)


def _elastic(spec: LaunchSpec, entrypoint: Callable[..., Any] | str, args: tuple) -> int:
    if callable(entrypoint):
        entrypoint, args = run_worker, (entrypoint, *args)
    # A stop signal on a node of an elastic job: that node leaves, the others go on (membership.py).
    on_stop = membership.leave_when_shut_down if spec.elastic else None
    with _node(spec) as port, Supervisor(interrupt_main=spec.max_restarts > 0 or spec.elastic, on_stop=on_stop) as sup:
        config = LaunchConfig(
            min_nodes=spec.nnodes,
            max_nodes=spec.max_nodes or spec.nnodes,
            nproc_per_node=spec.nproc,
            max_restarts=spec.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            **_rdzv_options(spec, port),
            signals_to_handle=AGENT_SIGNALS,  # the stop signals are the Supervisor's (supervise.py)
        )
        _quiet_elastic_logs()
        try:
            with sup.armed():
                _run_agent(spec, config, entrypoint, args)
        except ChildFailedError as exc:
            if sup.signum:
                return sup.stopped()
            return _report_failure({rank: f.exitcode for rank, f in exc.failures.items()}, sup)
        except (KeyboardInterrupt, Stopped):
            return sup.stopped() if sup.signum else 130
        except DtrainError:
            raise
        except Exception as exc:  # the agent's own errors (rendezvous timeout, SIGQUIT)
            name = type(exc).__name__
            if name == "SignalException":
                return 128 + int(getattr(exc, "sigval", 15))
            if name == "RendezvousTimeoutError":  # torch's says nothing more than its name
                raise LaunchError(membership.join_timed_out(advertised_address(spec.addr, spec.local_addr), f"{spec.addr}:{port}",
                                                            spec.nnodes, spec.max_nodes, spec.join_timeout)) from None
            if membership.finished_without_this_node(exc):
                print("dtrain: the job finished on the other node(s) while this node was joining (they closed the "
                      "rendezvous on success); nothing is left for this node to do.", file=sys.stderr, flush=True)
                return 0
            raise LaunchError(f"the elastic agent failed: {name}: {exc}") from None
        finally:
            membership.forget()
        if sup.signum:
            return sup.stopped()
    return 0


def _run_agent(spec: LaunchSpec, config: LaunchConfig, entrypoint: Any, args: tuple) -> None:
    """torch's agent; in an elastic job again (up to --max-restarts times) when a node was lost while
    a round assigned ranks (torch's ``_assign_worker_ranks`` then fails the survivors' agents with
    a store timeout). The failed agent left the rendezvous (membership.py): the next one joins the next round."""
    attempts = spec.max_restarts if spec.elastic else 0
    while True:
        try:
            with _agent(spec):
                elastic_launch(config, entrypoint)(*args)
            return
        except (ChildFailedError, DtrainError, KeyboardInterrupt, Stopped):
            raise
        except Exception as exc:
            if attempts <= 0 or not membership.lost_in_rendezvous(exc):
                raise
            attempts -= 1
            print(f"dtrain: a node was lost while this round of the rendezvous assigned ranks ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160]}); this node joins the next round.", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _agent(spec: LaunchSpec) -> Iterator[None]:
    """An elastic job's agents use membership's exit barrier (torch's launch_agent builds its agent
    from its module's ``LocalElasticAgent``; the name is swapped back after)."""
    import torch.distributed.launcher.api as launcher

    if not spec.elastic:
        yield
        return
    torch_agent = launcher.LocalElasticAgent
    launcher.LocalElasticAgent = membership.agent_class()
    try:
        yield
    finally:
        launcher.LocalElasticAgent = torch_agent


def _rdzv_options(spec: LaunchSpec, port: int) -> dict[str, Any]:
    if spec.elastic:
        # torch's c10d rendezvous through membership's handler. Who hosts is decided here (is_host):
        # torch guesses from host names, and two launchers on one host would both guess "host".
        # local_addr: torch's default, socket.getfqdn(), often resolves to 127.0.x.1.
        return {"run_id": spec.rdzv_id, "rdzv_backend": membership.register(), "rdzv_endpoint": f"{spec.addr}:{port}",
                "local_addr": advertised_address(spec.addr, spec.local_addr),
                "rdzv_configs": {"join_timeout": int(spec.join_timeout), "last_call_timeout": int(spec.last_call_s),
                                 "close_timeout": 30, "is_host": _can_bind(spec.addr, port),
                                 "read_timeout": max(1, int(spec.startup_timeout)),
                                 # A lost node's keep-alive expires sooner than torch's 5 s x 3 (diag/startwatch.py).
                                 "keep_alive_interval": membership.KEEP_ALIVE_S,
                                 "keep_alive_max_attempt": membership.KEEP_ALIVE_ATTEMPTS}}
    return {"run_id": f"dtrain-{uuid.uuid4().hex[:8]}" if spec.nnodes == 1 else "dtrain", "rdzv_backend": "static",
            # The nodes met in the pre-launch check; the agents' store waits (a node lost since then) get the start-up bound.
            "rdzv_endpoint": f"{spec.addr}:{port}", "rdzv_configs": {"rank": spec.node_rank, "timeout": max(1, int(spec.startup_timeout))},
            "local_addr": spec.addr if spec.nnodes == 1 else spec.local_addr}


def _can_bind(addr: str, port: int) -> bool:
    """Whether this node can listen on ``addr:port``: it is the endpoint's node and nobody hosts yet."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as sock:
            # Bound, never listening (another node's connect must not land here); as the store's own
            # bind, a previous job's connections in TIME_WAIT do not count, a live listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
        return True
    except OSError:
        return False


def _spawn_worker(local_rank: int, spec: LaunchSpec, port: int, fn: Callable[..., Any], args: tuple) -> None:
    rank = spec.node_rank * spec.nproc + local_rank
    os.environ.update(worker_env(rank, local_rank, spec.world_size, spec.nproc, spec.node_rank, spec.addr, port))
    run_worker(fn, *args)


def _spawn(spec: LaunchSpec, fn: Callable[..., Any], args: tuple) -> int:
    _quiet_elastic_logs()  # and torch.multiprocessing's "Terminating process ..." warnings
    with _node(spec) as port, Supervisor() as sup:
        try:
            mp.spawn(_spawn_worker, args=(spec, port, fn, args), nprocs=spec.nproc, join=True)
        except mp.ProcessExitedException as exc:
            if sup.signum:
                return sup.stopped()
            return _report_failure({spec.node_rank * spec.nproc + exc.error_index: exc.exit_code}, sup)
        except mp.ProcessRaisedException as exc:
            print(str(exc), file=sys.stderr)
            return _report_failure({spec.node_rank * spec.nproc + exc.error_index: 1}, sup)
        except KeyboardInterrupt:
            return sup.stopped() if sup.signum else 130
        if sup.signum:
            return sup.stopped()
    return 0


@contextlib.contextmanager
def _node(spec: LaunchSpec) -> Iterator[int]:
    """This node's part of a launch: the rendezvous (yields its port), torchrun's rule of one
    OpenMP thread per worker unless the user set it, and the sockets' interface."""
    with _rendezvous(spec) as port, _env_default("OMP_NUM_THREADS", "1" if spec.nproc > 1 else None), _socket_interface(spec):
        yield port


@contextlib.contextmanager
def _env_default(key: str, value: str | None) -> Iterator[None]:
    """Set ``key`` for the children unless the user set it."""
    if value is None or key in os.environ:
        yield
        return
    os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _report_failure(exit_codes: dict[int, int], sup: Supervisor) -> int:
    first = sup.first_error()
    if first is not None:  # the cause; the others' (a peer's closed socket) follow from it
        if first["user_error"]:
            print(first["text"], file=sys.stderr)
            return USER_ERROR_EXIT
        print(f"dtrain: worker rank {first['rank']} raised:\n{first['text']}", file=sys.stderr)
        print(f"dtrain: error: worker rank {first['rank']} failed with {first['type']}; its traceback is above.", file=sys.stderr)
        return 1
    # The lowest rank that exited by itself: a peer the agent killed after it (signal 15) is not the cause.
    rank = min(exit_codes, key=lambda r: (exit_codes[r] is None or exit_codes[r] < 0, r))
    code = exit_codes[rank]
    if code == USER_ERROR_EXIT:
        return code  # the worker printed its one-line error already
    if code is None or code < 0:
        sig = -code if code else "?"
        print(f"dtrain: error: worker rank {rank} was killed by signal {sig}; see its output above.", file=sys.stderr)
        return 1
    if code == REJOIN_EXIT:
        print(f"dtrain: error: worker rank {rank} saved and stopped for a membership change (status {code}), but this "
              "node's --max-restarts are used up, so it does not rejoin; raise --max-restarts.", file=sys.stderr)
        return code
    if code == STALL_EXIT:
        print(f"dtrain: error: worker rank {rank} was stopped by the stall watchdog (status {code}); see the stall report above.", file=sys.stderr)
        return code
    print(f"dtrain: error: worker rank {rank} exited with status {code}; see its output above.", file=sys.stderr)
    return code or 1
