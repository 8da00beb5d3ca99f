"""Preflight checks of ``dtrain doctor``: one line each, PASS/WARN/FAIL/INFO, and the fix on a FAIL (the all-reduce probe's check: ``doctor_probe``)."""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import resource
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._version import __version__
from ..errors import DtrainError, first_line
from ..launch import preflight
from ..launch.store import host_store
from ..world import netif


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, WARN, FAIL, INFO; WAIT: a progress line while a check waits (never a result)
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"  -> fix: {self.fix}" if self.status == "FAIL" and self.fix else (f"  -> {self.fix}" if self.fix else "")
        return f"{self.status:<4}  {self.name:<18} {self.detail}{fix}"


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    probe: bool = True
    """Run the all-reduce probe (starts 2 local processes, or one per node)."""
    timeout_s: float = 30.0
    links_out: str | None = None
    """Also time every collective at a few sizes and write them here (JSON, for ``dtrain plan --links``; node 0)."""


def check_torch() -> Check:
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items())
    ok = backends["gloo"] or backends["nccl"]
    return Check("torch", "PASS" if ok else "FAIL", f"torch {torch.__version__}, dtrain {__version__}; backends: {have}",
                 "" if ok else "install a torch build with distributed support (gloo)")


def check_devices() -> Check:
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("devices", "PASS", f"{torch.cuda.device_count()} CUDA device(s): {names}; backend nccl")
    return Check("devices", "INFO", f"no CUDA device; {os.cpu_count()} CPU cores; backend gloo")


def check_env(env: dict[str, str]) -> Check:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = {k: env[k] for k in keys if k in env}
    if not present:
        return Check("environment", "INFO", "no RANK/WORLD_SIZE/MASTER_* set (fine: `dtrain run` sets them for its workers)")
    problems = []
    if ("RANK" in present) != ("WORLD_SIZE" in present):
        problems.append("RANK and WORLD_SIZE must be set together")
    try:
        ints = {k: int(v) for k, v in present.items() if k != "MASTER_ADDR"}
    except ValueError as exc:
        return Check("environment", "FAIL", f"{present}", f"a variable is not an integer ({exc})")
    if "RANK" in ints and "WORLD_SIZE" in ints and not 0 <= ints["RANK"] < ints["WORLD_SIZE"]:
        problems.append(f"RANK={ints['RANK']} is outside WORLD_SIZE={ints['WORLD_SIZE']}")
    if "LOCAL_RANK" in ints and "LOCAL_WORLD_SIZE" in ints and not 0 <= ints["LOCAL_RANK"] < ints["LOCAL_WORLD_SIZE"]:
        problems.append(f"LOCAL_RANK={ints['LOCAL_RANK']} is outside LOCAL_WORLD_SIZE={ints['LOCAL_WORLD_SIZE']}")
    if "WORLD_SIZE" in ints and "LOCAL_WORLD_SIZE" in ints and ints["WORLD_SIZE"] % max(1, ints["LOCAL_WORLD_SIZE"]):
        problems.append(f"WORLD_SIZE={ints['WORLD_SIZE']} is not a multiple of LOCAL_WORLD_SIZE={ints['LOCAL_WORLD_SIZE']}")
    if ints.get("WORLD_SIZE", 1) > 1 and "MASTER_ADDR" not in present:
        problems.append("WORLD_SIZE > 1 but MASTER_ADDR is not set")
    shown = " ".join(f"{k}={v}" for k, v in present.items())
    if problems:
        return Check("environment", "FAIL", shown, "; ".join(problems))
    return Check("environment", "PASS", shown)


def check_network(cfg: DoctorConfig) -> Check:
    addr = cfg.master_addr or "127.0.0.1"
    try:
        ip = socket.gethostbyname(addr)
    except socket.gaierror as exc:
        return Check("network", "FAIL", f"master address {addr} does not resolve ({exc.strerror})", "give node 0's IP address with --master-addr")
    local = netif.source_address(ip)  # what peers will see: the source address of the route there
    if local is None:
        return Check("network", "FAIL", f"no route from this host to {ip}", "check the address and this host's routes")
    iface = netif.interface_of(local)
    host = socket.gethostname()
    try:
        host_ip = socket.gethostbyname(host)
    except socket.gaierror:
        host_ip = "unresolvable"
    detail = f"peers see this node as {local}" + (f" (interface {iface})" if iface else "") + f"; host name {host} -> {host_ip}"
    problem = netif.user_interface_problem(addr, os.environ, [netif.BACKEND_VARIABLE["nccl" if torch.cuda.is_available() else "gloo"]])
    if problem is not None:
        what, _, fix = problem.partition("; ")
        return Check("network", "FAIL", f"{detail}; {what}", fix)
    if cfg.nnodes > 1:
        if ip.startswith("127.") or local.startswith("127."):
            return Check("network", "FAIL", detail + f"; master {addr} is a loopback address",
                         "use node 0's address on the network the nodes share (not 127.0.0.1) for --master-addr")
    if host_ip.startswith("127.") and _has_network_address():
        # pytorch#111646: a launcher that advertises the host name tells the other nodes to connect to their own loopback.
        where = f"{local}" if not local.startswith("127.") else "this node's network address"
        return Check("network", "WARN" if cfg.nnodes > 1 or cfg.master_addr is None else "PASS", detail,
                     f"the host name resolves to loopback: a multi-node job that advertises host names (plain torchrun, "
                     f"`torchrun --nnodes MIN:MAX` without --local-addr) hangs here; dtrain advertises {where} instead "
                     f"(--local-addr to choose); or map {host} to {where} in /etc/hosts")
    return Check("network", "PASS", detail)


def _has_network_address() -> bool:
    """Whether this host has an address besides loopback (else it is one node by nature)."""
    return any(not netif.is_loopback(a) and not a.startswith("fe80") for n, addrs in netif.interface_addresses().items()
               for a in addrs)


def check_port(cfg: DoctorConfig, say: Callable[[str], None] = print) -> Check:
    """Node 0: the port is free; another node: node 0 listens there (``say`` prints the lines while it waits)."""
    addr = cfg.master_addr or "127.0.0.1"
    port = cfg.master_port
    if port is None:
        return Check("port", "INFO", "no --master-port given (one node picks a free port)")
    if cfg.node_rank == 0:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError as exc:
                fix = "choose another --master-port" if exc.errno == errno.EADDRINUSE else f"run node 0 on the host that owns {addr}"
                return Check("port", "FAIL", f"cannot listen on {addr}:{port} ({exc.strerror})", fix)
        return Check("port", "PASS", f"{addr}:{port} is free on node 0")
    # Nodes start in any order (SLURM, k8s): wait for node 0 as `dtrain run` does, within --timeout.
    try:
        preflight.wait_for_master(addr, port, timeout_s=cfg.timeout_s, me=f"node {cfg.node_rank}", bound="--timeout",
                                  fix="start `dtrain doctor --node-rank 0` on node 0 with the same --master-addr and --master-port",
                                  waiting="node 0's doctor has not started yet, or a wrong --master-addr/--master-port?",
                                  say=lambda note: say(Check("port", "WAIT", note).line()))
    except DtrainError as exc:  # one line "what; fix", as Check shows it
        what, _, fix = str(exc).partition("; ")
        return Check("port", "FAIL", what, fix.rstrip("."))
    return Check("port", "PASS", f"{addr}:{port} accepts connections")


def check_rendezvous(cfg: DoctorConfig) -> tuple[Check, dist.Store | None, bool]:
    """Meet the other nodes' doctors in node 0's store; returns the check, the store (kept open
    for the probe) and whether every node runs the all-reduce probe."""
    addr = cfg.master_addr or "127.0.0.1"
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    t0 = time.perf_counter()
    mine = {"nnodes": cfg.nnodes, "probe": cfg.probe}
    probes = True
    try:
        if cfg.node_rank == 0:  # bound to the master address only (TCPStore alone listens on every interface)
            store, _ = host_store(addr, cfg.master_port or 0, timeout_s=cfg.timeout_s)
        else:
            store = dist.TCPStore(addr, cfg.master_port, None, False, timeout)
        store.set(f"doctor/{cfg.node_rank}", json.dumps(mine))
        for r in range(cfg.nnodes):
            theirs = json.loads(store.get(f"doctor/{r}"))
            if theirs["nnodes"] != cfg.nnodes:
                if cfg.node_rank == 0:
                    time.sleep(2)  # keep the store up a moment so node r can read our view and say why too
                return Check("rendezvous", "FAIL", f"node {r} runs the doctor with --nnodes {theirs['nnodes']}, this node with {cfg.nnodes}",
                             "give every node the same --nnodes"), None, False
            probes = probes and theirs["probe"]
        rtts = []
        for _ in range(20):
            t = time.perf_counter()
            store.get(f"doctor/{cfg.node_rank}")
            rtts.append((time.perf_counter() - t) * 1e3)
        store.set(f"doctor/done/{cfg.node_rank}", "1")
        if cfg.node_rank == 0:  # node 0 hosts the store: keep it up until every node has its answers
            for r in range(cfg.nnodes):
                store.get(f"doctor/done/{r}")
    except (RuntimeError, ValueError, DtrainError) as exc:
        first = first_line(exc)
        return Check("rendezvous", "FAIL", f"no rendezvous with {cfg.nnodes} node(s) at {addr} within {cfg.timeout_s:g} s ({first})",
                     "start `dtrain doctor` on every node with the same --nnodes, --master-addr and --master-port"), None, False
    return Check("rendezvous", "PASS", f"{cfg.nnodes} node(s) met at {addr}:{store.port} in {time.perf_counter() - t0:.2f} s; "
                 f"store round trip {statistics.median(rtts):.2f} ms"), store, probes


def check_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", "WARN", "no /dev/shm", "DataLoader workers and NCCL use shared memory; mount a tmpfs at /dev/shm")
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    detail = f"{size / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"
    if size < 256 * 2**20:
        return Check("/dev/shm", "FAIL", detail, "DataLoader workers and NCCL need more; in docker use --shm-size=8g (or --ipc=host)")
    return Check("/dev/shm", "PASS", detail)


def check_nofile() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"soft {soft}, hard {hard}"
    if soft < 1024:
        return Check("open files", "FAIL", detail, "raise it: `ulimit -n 65536` (each peer connection and worker uses descriptors)")
    if soft < 4096:
        return Check("open files", "WARN", detail, "large jobs may need more: `ulimit -n 65536`")
    return Check("open files", "PASS", detail)


def run_doctor(cfg: DoctorConfig, env: dict[str, str] | None = None, echo: Callable[[str], None] = print) -> list[Check]:
    env = dict(os.environ) if env is None else env
    checks: list[Check] = []

    def add(c: Check) -> None:
        checks.append(c)
        echo(c.line())

    add(check_torch())
    add(check_devices())
    add(check_env(env))
    add(check_network(cfg))
    port = check_port(cfg, echo)
    add(port)
    store, probes = None, False
    if port.status != "FAIL":
        rdzv, store, probes = check_rendezvous(cfg)
        add(rdzv)
    from .doctor_probe import check_allreduce  # the probe's module uses this one's Check

    add(check_allreduce(cfg, store if probes else None))
    del store
    add(check_shm())
    add(check_nofile())
    return checks


def environment_report() -> str:
    """Versions and settings to paste into a bug report (`dtrain env`)."""
    lines = [f"dtrain {__version__}", f"torch {torch.__version__} (git {getattr(torch.version, 'git_version', '?')[:12]})",
             f"python {platform.python_version()} on {platform.platform()}", f"cpu: {os.cpu_count()} cores, {platform.machine()}"]
    import numpy

    lines.append(f"numpy {numpy.__version__}")
    lines.append(f"distributed backends: gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}, mpi {dist.is_mpi_available()}")
    if torch.cuda.is_available():
        lines.append(f"cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}, nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda: not available")
    lines.append(f"host {socket.gethostname()}")
    prefixes = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "NCCL_", "GLOO_", "TORCH", "OMP_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES", "SLURM_", "DTRAIN_", "PYTORCH_")
    shown = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    lines.append("environment:" if shown else "environment: (no distributed settings)")
    lines.extend(f"  {k}={v}" for k, v in shown)
    return "\n".join(lines)
