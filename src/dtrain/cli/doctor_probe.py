"""``dtrain doctor``'s all-reduce probe: between local processes (one per GPU on nccl), or between
the nodes, one process each, over the doctor's rendezvous store; with ``--links-out`` every
collective's times for ``dtrain plan --links``. The timing itself is ``dtrain.diag.probe``'s."""

from __future__ import annotations

import datetime
import json
import os
import threading

import torch
import torch.distributed as dist

from ..diag.probe import bus_bandwidth, time_all_reduce, time_collectives
from ..launch import preflight
from ..launch.local import run_distributed
from ..world import destroy_process_group, netif
from .doctor_checks import Check, DoctorConfig

_SIZES = [8, 1 << 20, 16 << 20]


def _probe_body(sizes: list[int], reps: int, device: str | None = None, links: bool = False) -> tuple[dict[int, float], dict | None]:
    """Collective: every rank. The probe between local processes (``device`` None: each rank's GPU);
    with ``links``, every collective's times too."""
    import dtrain

    ctx = dtrain.init("single", device=device, stall_timeout=0)
    out = time_all_reduce(ctx.device, sizes, reps)
    coll = time_collectives(ctx.device) if links else None
    ctx.close()
    return out, coll


def _probe_nodes(cfg: DoctorConfig, store: dist.Store, connected: threading.Event) -> tuple[dict[int, float], dict | None]:
    """Collective: every node's doctor. The probe between the nodes over the doctor's store, its
    sockets on the interface that routes to the master, as a job's are (``netif.socket_env``)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    chosen = netif.socket_env(cfg.master_addr, os.environ) if cfg.master_addr else {}
    os.environ.update(chosen)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("doctor/probe", store), rank=cfg.node_rank,
                                world_size=cfg.nnodes, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        connected.set()
        try:
            return time_all_reduce(device, _SIZES, 10), (time_collectives(device) if cfg.links_out else None)
        finally:
            destroy_process_group()
    finally:
        for name in chosen:
            os.environ.pop(name, None)


class _NoConnection(Exception):
    """The nodes met in the store but their process group did not connect within --timeout."""


abandoned_probe = False
"""Set when a probe thread was left in gloo's connect: the doctor then leaves with ``os._exit``
(the thread would take the GIL while the interpreter finalizes when gloo gives up)."""


def _probe_nodes_bounded(cfg: DoctorConfig, store: dist.Store) -> tuple[dict[int, float], dict | None]:
    """``_probe_nodes`` with its connection bounded by ``--timeout`` (gloo retries a peer it cannot
    reach for its own ~100 s whatever the group's timeout); once connected, the collectives run to the end."""
    global abandoned_probe
    connected, box = threading.Event(), {}

    def body() -> None:
        try:
            box["out"] = _probe_nodes(cfg, store, connected)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["exc"] = exc
        finally:
            connected.set()

    thread = threading.Thread(target=body, name="dtrain-doctor-probe", daemon=True)
    thread.start()
    if not connected.wait(cfg.timeout_s + 5):
        abandoned_probe = True
        raise _NoConnection(f"no connection between the nodes within {cfg.timeout_s:g} s of their meeting in the store")
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def _write_links(cfg: DoctorConfig, seconds: dict, ranks: int, backend: str) -> str:
    """``--links-out``: the collectives' times as ``dtrain plan --links`` reads them; a note for the check's line."""
    if cfg.node_rank != 0:
        return ""
    record = {"between": "nodes" if cfg.nnodes > 1 else "processes", "ranks": ranks, "backend": backend,
              "device": "cuda" if backend == "nccl" else "cpu", "load": os.getloadavg()[0], "seconds": {k: {str(b): s for b, s in v.items()} for k, v in seconds.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(cfg.links_out)), exist_ok=True)  # as --links-out's check allowed
    with open(cfg.links_out, "w") as fh:
        json.dump(record, fh, indent=1)
    return f"; every collective's times written to {cfg.links_out}"


def check_allreduce(cfg: DoctorConfig, store: dist.Store | None = None) -> Check:
    if not cfg.probe:
        return Check("all-reduce", "INFO", "probe skipped (--no-probe)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    n, who, note = (cfg.nnodes, f"{cfg.nnodes} nodes", "") if cfg.nnodes > 1 else (0, "", "")
    try:
        if cfg.nnodes > 1:
            if store is None:
                return Check("all-reduce", "INFO", "probe between the nodes skipped (no rendezvous, or a node runs with --no-probe)")
            res, coll = _probe_nodes_bounded(cfg, store)
        else:
            n, device, note = local_probe_size(preflight.cuda_device_count())
            backend = "gloo" if device == "cpu" else "nccl"
            who = f"{n} local processes"
            res, coll = run_distributed(_probe_body, _SIZES, 10, device, bool(cfg.links_out), world_size=n,
                                         timeout=300 if cfg.links_out else 120)[0]
    except Exception as exc:  # noqa: BLE001 - any failure is the check's result
        first = _cause(exc)
        fix = ("the nodes met in the store but cannot connect to each other: set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the "
               "interface of the network the nodes share, and open the ports between them") if cfg.nnodes > 1 else "run `dtrain env` and report it"
        return Check("all-reduce", "FAIL", f"{who} could not all-reduce ({first})", fix)
    lat = res[8] * 1e6
    bw = bus_bandwidth(16 << 20, res[16 << 20], n) / 1e9
    if coll is not None:
        note += _write_links(cfg, coll, n, backend)
    return Check("all-reduce", "PASS", f"{who} ({backend}): latency {lat:.0f} us (8 B), "
                 f"bus bandwidth {bw:.2f} GB/s (16 MiB, nccl-tests' definition){note}")


#: At most this many local processes in the probe (one per GPU): enough to see the links.
PROBE_MAX_PROCS = 8


def local_probe_size(gpus: int) -> tuple[int, str | None, str]:
    """(processes, their device, a note) of the one-node probe: one process per GPU on nccl (NCCL
    refuses two ranks on one GPU), else two CPU processes on gloo (no pair of GPUs)."""
    if gpus >= 2:
        return min(gpus, PROBE_MAX_PROCS), None, ""
    if gpus == 1:
        return 2, "cpu", "; 1 GPU: no GPU pair on this node, so the probe used gloo on the CPU"
    return 2, "cpu", ""


def _cause(exc: BaseException) -> str:
    """One line that says why: a failed rank's own exception where the harness has it."""
    from ..launch.local import DistributedTestError

    if isinstance(exc, DistributedTestError):
        return exc.first_cause()[:300]
    if isinstance(exc, _NoConnection):
        return str(exc)
    text = str(exc).strip()
    return (f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__)[:300]
