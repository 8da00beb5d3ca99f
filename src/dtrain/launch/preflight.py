"""Checks the launcher makes before any worker starts, so that a misconfigured multi-node job
fails in seconds with one clear line: the master address answers, node 0 sees every other node
within ``--startup-timeout``, and every node has the same ``--nnodes``, ``-n`` and versions.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._log import logger
from ..errors import ConfigError, LaunchError, first_line
from ..world.group import versions, versions_differ
from ..world.reach import refusal, wait_for_listener
from .spec import LaunchSpec

#: A waiting node says so after FIRST_NOTE_S (nodes started together have met by then), then every NOTE_EVERY_S.
FIRST_NOTE_S = 3.0
NOTE_EVERY_S = 30.0
#: Silence (timed-out connections, not refused ones) this long ends a wait early: something drops the packets.
UNREACHABLE_S = 20.0


class Notes:
    """When a waiting node prints its next progress line (see FIRST_NOTE_S)."""

    def __init__(self) -> None:
        self._next = FIRST_NOTE_S

    def due(self, elapsed_s: float) -> bool:
        if elapsed_s < self._next:
            return False
        self._next = elapsed_s + NOTE_EVERY_S
        return True


def wait_for_master(addr: str, port: int, *, timeout_s: float, me: str = "this node", what: str = "node 0",
                    fix: str = "start node 0 (--node-rank 0) there with the same --master-addr and --master-port",
                    waiting: str = "not started yet, or a wrong --master-addr/--master-port?", bound: str = "--startup-timeout",
                    say: Callable[[str], None] | None = None) -> None:
    """Return once ``addr:port`` accepts a TCP connection, waiting out refusals up to ``timeout_s``
    (``UNREACHABLE_S`` of no reply, or no route, end it sooner); else one line naming ``me``, ``what``
    it waited for, and ``fix`` (for a refusal). ``bound``: the flag that sets ``timeout_s``; ``say``:
    where the progress lines go (dtrain's log by default; ``dtrain doctor`` prints its own)."""
    notes, say = Notes(), say or logger.info
    where = f"{me} could not connect to {what} at {addr}:{port}"
    check = f"check that {addr} is the address of {what} as this node sees it, and that no firewall drops the port"
    seen = {"silent": 0.0, "at": 0.0}

    def on_wait(elapsed: float, error: OSError) -> None:
        if error.errno == errno.ENETUNREACH:
            raise LaunchError(f"{where}: {refusal(error)} (this node has no route there); {check}.")
        refused = error.errno == errno.ECONNREFUSED
        if not refused:  # packets dropped, or no host at that address (yet)
            seen["silent"] += elapsed - seen["at"]
        seen["at"] = elapsed
        if elapsed >= timeout_s:
            raise LaunchError(f"{where} within {timeout_s:g} s: {refusal(error)}; {fix if refused else check}, or raise "
                              f"{bound}.")
        if seen["silent"] >= UNREACHABLE_S:
            raise LaunchError(f"{where}: {refusal(error)} for {seen['silent']:.0f} s; {check}.")
        if notes.due(elapsed):
            say(f"{me}: waiting for {what} at {addr}:{port} ({elapsed:.0f} s of {timeout_s:g} s): {refusal(error)}; {waiting}")

    error = wait_for_listener(addr, port, timeout_s, on_wait)
    if error is not None:  # a name that does not resolve (no other error gets here)
        raise ConfigError(f"--master-addr {addr} does not resolve ({error.strerror}); give {what}'s IP address.")


def connect_store(addr: str, port: int, handshake_s: float = 20.0) -> dist.TCPStore:
    """A client of node 0's rendezvous store; a listener that does not answer as a store within ``handshake_s`` is an error."""
    t0 = time.monotonic()
    box: dict = {}

    def connect() -> None:  # TCPStore's handshake can block without limit on a silent peer
        try:
            box["store"] = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=handshake_s))
        except (RuntimeError, ValueError) as exc:
            box["error"] = first_line(exc)

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
    return {"nnodes": spec.nnodes, "nproc": spec.nproc, **versions()}


#: Node 0's word to the other nodes once it has checked them all: "ok", or why the job does not start.
_VERDICT = "verdict"
_POLL_S = 0.2


def check_nodes(spec: LaunchSpec, port: int, *, timeout_s: float) -> None:
    """Post this node's view to the rendezvous store and compare it with the others'. Node 0 waits
    up to ``timeout_s`` for every node, then gives them its verdict, so no node's agent starts
    toward a job that node 0 gave up on. LaunchError (one line) on a mismatch or a missing node."""
    handshake = min(20.0, timeout_s)
    store = dist.PrefixStore("/dtrain/preflight", connect_store(spec.addr, port, handshake_s=handshake))
    store.set_timeout(datetime.timedelta(seconds=max(handshake, 5.0)))  # each read below is of a key that exists
    mine = node_view(spec)
    try:
        store.set(f"node/{spec.node_rank}", json.dumps(mine))
        if spec.node_rank == 0:
            _gather(store, spec, mine, f"{spec.addr}:{port}", timeout_s)
        else:
            _follow(store, spec, mine, f"{spec.addr}:{port}", time.monotonic() + timeout_s + 5.0)  # node 0 started waiting first; its verdict comes before this
    except (RuntimeError, ValueError) as exc:  # the store went away
        first = first_line(exc)
        raise LaunchError(f"the pre-launch check with the other nodes failed ({first}); see node 0's output.") from None


def _gather(store: dist.Store, spec: LaunchSpec, mine: dict, where: str, timeout_s: float) -> None:
    """Node 0: every other node's view (at ``where``), compared with this one's, within ``timeout_s``."""
    missing = list(range(1, spec.nnodes))
    notes, start = Notes(), time.monotonic()
    while True:
        for r in [r for r in missing if store.check([f"node/{r}"])]:
            missing.remove(r)
            try:
                _compare(mine, 0, json.loads(store.get(f"node/{r}")), r)
            except LaunchError as exc:
                _give_up(store, str(exc), linger_s=2.0)  # node r reads our view meanwhile and says why too
                raise
        if not missing:
            store.set(_VERDICT, "ok")
            return
        elapsed = time.monotonic() - start
        who = ", ".join(map(str, missing))
        if elapsed >= timeout_s:
            error = LaunchError(
                f"node 0 waited {timeout_s:g} s at {where} for node(s) {who} of --nnodes {spec.nnodes}, which never "
                f"connected; start every node with --nnodes {spec.nnodes} --master-addr {spec.addr} (and the same "
                "--master-port), each with its own --node-rank, check that they can reach this address, or raise "
                "--startup-timeout.")
            _give_up(store, str(error), linger_s=1.0)
            raise error
        if notes.due(elapsed):
            logger.info(f"waiting for {len(missing)} more node(s) at {where} ({elapsed:.0f} s of {timeout_s:g} s): "
                        f"node(s) {who} not connected yet")
        time.sleep(_POLL_S)


def _follow(store: dist.Store, spec: LaunchSpec, mine: dict, where: str, deadline: float) -> None:
    """A node other than 0: compare with node 0's view, then wait for node 0's verdict."""
    for key in ("node/0", _VERDICT):
        while not store.check([key]):
            if time.monotonic() >= deadline:
                raise LaunchError(f"node {spec.node_rank} waited for node 0 at {where} to check every "
                                  f"node of --nnodes {spec.nnodes}, and it did not say; see node 0's output.")
            time.sleep(_POLL_S)
        if key == "node/0":
            _compare(mine, spec.node_rank, json.loads(store.get(key)), 0)
    verdict = store.get(_VERDICT).decode()
    if verdict != "ok":
        raise LaunchError(verdict)


def _give_up(store: dist.Store, why: str, *, linger_s: float) -> None:
    """Tell the other nodes why the job does not start, and keep the store up a moment for them to read it."""
    try:
        store.set(_VERDICT, why)
    except (RuntimeError, ValueError):
        return
    time.sleep(linger_s)


def _compare(mine: dict, me: int, theirs: dict, other: int) -> None:
    if (mine["nnodes"], mine["nproc"]) != (theirs["nnodes"], theirs["nproc"]):
        raise LaunchError(
            f"nodes disagree on the job's size: node {me} ({mine['host']}) was started with --nnodes {mine['nnodes']} "
            f"-n {mine['nproc']} (world size {mine['nnodes'] * mine['nproc']}), node {other} ({theirs['host']}) with "
            f"--nnodes {theirs['nnodes']} -n {theirs['nproc']} (world size {theirs['nnodes'] * theirs['nproc']}); "
            "start every node with the same --nnodes and -n."
        )
    error = versions_differ(mine, theirs, f"node {me}", f"node {other}")
    if error is not None:
        raise error


def check_ranks_fit(nproc: int, device: str | None = None, *, cpu_fix: str = "--device cpu", gpus: int | None = None) -> None:
    """Before any process starts: each of the ``nproc`` ranks on CUDA needs a GPU of its own (NCCL's
    "Duplicate GPU detected" otherwise surfaces as a failed rendezvous). ``device``: what the ranks
    were told (None: CUDA when there is one); ``cpu_fix``: how this command trains on the CPU."""
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
    """The GPUs this process can use (0 without CUDA); the one place that counts them, so tests
    can fake the count (``DTRAIN_FAKE_GPUS``)."""
    from ..options import TestHooks, section

    fake = section(TestHooks).fake_gpus
    if fake is not None:
        return fake
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU; World.detect reports what is there
        return 0
