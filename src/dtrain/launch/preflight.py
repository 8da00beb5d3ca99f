"""Checks the launcher makes before any worker starts, so that a misconfigured multi-node job
fails in seconds with one clear line instead of waiting for a rendezvous timeout:

- the master address answers (connection refused is fine: node 0 may start later; no answer or
  no route for ``unreachable_s`` is an error),
- every node was started with the same ``--nnodes`` and ``-n``, and runs the same dtrain, torch
  and Python versions (each node posts its view to node 0's rendezvous store and compares).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import socket
import threading
import time

import torch
import torch.distributed as dist

from .._log import logger
from .._version import __version__
from ..errors import ConfigError, LaunchError
from .spec import LaunchSpec


def wait_for_master(addr: str, port: int, *, total_s: float = 900.0, unreachable_s: float = 20.0) -> None:
    """Return once ``addr:port`` accepts a TCP connection; raise after ``unreachable_s`` of no
    answer (or at once for no route), or after ``total_s`` of refused connections."""
    start = time.monotonic()
    silent = 0.0
    last_note = start
    while True:
        t0 = time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=5):
                return
        except socket.gaierror as exc:
            raise ConfigError(f"--master-addr {addr} does not resolve ({exc.strerror}); give node 0's IP address.") from None
        except socket.timeout:
            silent += time.monotonic() - t0
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                raise LaunchError(f"--master-addr {addr} is unreachable from this node (no route to host); check the address and the network.") from None
            if exc.errno != errno.ECONNREFUSED:
                silent += time.monotonic() - t0
            time.sleep(0.5)
        now = time.monotonic()
        if silent >= unreachable_s:
            raise LaunchError(
                f"--master-addr {addr}:{port} does not answer (no reply for {unreachable_s:.0f} s); check that it is node 0's "
                "address as this node sees it, and that no firewall drops the port."
            )
        if now - start > total_s:
            raise LaunchError(f"node 0 is not listening on {addr}:{port} after {total_s:.0f} s; start node 0 (--node-rank 0) there.")
        if now - last_note > (10 if last_note == start else 30):  # first note after 10 s, then every 30 s
            logger.info(f"waiting for node 0 at {addr}:{port}: connection refused (node 0 not started yet, "
                        "or a wrong --master-addr/--master-port?)")
            last_note = now


def connect_store(addr: str, port: int, handshake_s: float = 20.0) -> dist.TCPStore:
    """A client of node 0's rendezvous store. Something that accepts TCP connections but does
    not answer as a store (a proxy, another service) is an error after ``handshake_s``."""
    t0 = time.monotonic()
    box: dict = {}

    def connect() -> None:  # TCPStore's handshake can block without limit on a silent peer
        try:
            box["store"] = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=handshake_s))
        except (RuntimeError, ValueError) as exc:
            box["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(handshake_s + 1)
    if "store" in box:
        return box["store"]
    why = box.get("error", "no answer")
    raise LaunchError(
        f"--master-addr {addr}:{port} accepted a connection but did not answer as node 0's rendezvous store within "
        f"{time.monotonic() - t0:.0f} s ({why}); check that it is node 0's address and port."
    )


def node_view(spec: LaunchSpec) -> dict:
    return {"nnodes": spec.nnodes, "nproc": spec.nproc, "dtrain": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "host": socket.gethostname()}


def check_nodes(spec: LaunchSpec, port: int, *, timeout_s: float = 900.0) -> None:
    """Post this node's view to the rendezvous store and compare it with the others' (node 0
    waits for every node; the others compare with node 0). Raises LaunchError on a mismatch."""
    store = dist.PrefixStore("/dtrain/preflight", connect_store(spec.addr, port))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    mine = node_view(spec)
    others = range(1, spec.nnodes) if spec.node_rank == 0 else [0]
    try:
        store.set(f"node/{spec.node_rank}", json.dumps(mine))
        for r in others:
            theirs = json.loads(store.get(f"node/{r}"))  # waits until node r posts (or timeout)
            try:
                _compare(mine, spec.node_rank, theirs, r)
            except LaunchError:
                if spec.node_rank == 0:
                    time.sleep(2)  # keep the store up a moment so node r can read our view and say why too
                raise
    except (RuntimeError, ValueError) as exc:  # the store went away or timed out
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LaunchError(f"the pre-launch check with the other nodes failed ({first}); see node 0's output.") from None


def _compare(mine: dict, me: int, theirs: dict, other: int) -> None:
    if (mine["nnodes"], mine["nproc"]) != (theirs["nnodes"], theirs["nproc"]):
        raise LaunchError(
            f"nodes disagree on the job's size: node {me} ({mine['host']}) was started with --nnodes {mine['nnodes']} "
            f"-n {mine['nproc']} (world size {mine['nnodes'] * mine['nproc']}), node {other} ({theirs['host']}) with "
            f"--nnodes {theirs['nnodes']} -n {theirs['nproc']} (world size {theirs['nnodes'] * theirs['nproc']}); "
            "start every node with the same --nnodes and -n."
        )
    for key in ("dtrain", "torch", "python"):
        if mine[key] != theirs[key]:
            raise LaunchError(
                f"nodes run different {key} versions: node {me} ({mine['host']}) has {mine[key]}, node {other} "
                f"({theirs['host']}) has {theirs[key]}; install the same version on every node."
            )


def check_ranks_fit(nproc: int, device: str | None = None, *, cpu_fix: str = "--device cpu", gpus: int | None = None) -> None:
    """Before any process starts: the ``nproc`` ranks of this node each need a GPU of their own
    when they train on CUDA (NCCL refuses two ranks on one GPU: "Duplicate GPU detected", which
    otherwise surfaces as a failed rendezvous). ``device``: what the ranks were told (None: CUDA
    when there is one); ``cpu_fix``: how this command trains on the CPU instead; ``gpus``: the
    count (default: ``cuda_device_count()``)."""

    if device is not None and not str(device).startswith("cuda"):
        return
    gpus = cuda_device_count() if gpus is None else gpus
    if gpus == 0:
        return  # the CPU with gloo (a --device cuda without CUDA is check_device's error)
    where = f"{gpus} usable GPU(s)"
    if device is not None and ":" in str(device):
        gpus, where = 1, f"one GPU ({device}) for all of them"
    if nproc <= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"torch.cuda.device_count() with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "torch.cuda.device_count()"
    raise ConfigError(
        f"-n {nproc} starts {nproc} processes on this node but they have {where} ({seen}); NCCL needs a GPU per "
        f"process: use -n {gpus}, or {cpu_fix} to run {nproc} processes on the CPU with gloo."
    )


def cuda_device_count() -> int:
    """The GPUs this process can use: ``torch.cuda.device_count()`` (which honours
    CUDA_VISIBLE_DEVICES), 0 without CUDA. The one place that counts them, so the checks of ranks
    against GPUs (``dtrain.launch.preflight.check_ranks_fit``) are tested with a fake count
    (``DTRAIN_FAKE_GPUS``, or monkeypatching this function)."""
    from ..options import TestHooks, section

    fake = section(TestHooks).fake_gpus
    if fake is not None:
        return fake
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU; World.detect reports what is there
        return 0
