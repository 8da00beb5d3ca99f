"""A private SLURM cluster on this machine, for tests and benchmarks: ``munged``, ``slurmctld``
and two ``slurmd`` daemons that emulate two nodes (``slurmd -N n1``, ``slurmd -N n2``), each
with its own port and ``NodeAddr=127.0.0.1``, a private config, state and log folder, and
unprivileged ports. Nothing outside that folder is touched; ``stop()`` ends the daemons it
started (by their process ids) and nothing else.

    with PrivateSlurm.start(tmp_dir) as cluster:      # raises SlurmUnavailable with the reason
        subprocess.run(["srun", "-N2", "-n2", "hostname"], env=cluster.env)

Needs Debian's ``slurm-wlm`` and ``munge`` (``apt-get install slurm-wlm munge``). With two
``slurmd`` on one host the node names do not resolve; the jobs reach each other through
``NodeAddr``, which is what dtrain's master-address resolution is tested against.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
#: CPUs each emulated node advertises (config_overrides lets it exceed the real count).
CPUS_PER_NODE = 4
#: GPUs each node advertises: counted by SLURM only (no device files), so that jobs asking for
#: GPUs get SLURM_GPUS_ON_NODE as on a real GPU node; nothing uses a GPU.
GPUS_PER_NODE = 2
REQUIRED = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")


class SlurmUnavailable(RuntimeError):
    """The private cluster cannot be started here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


@dataclass
class PrivateSlurm:
    root: Path
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM's client commands (sbatch, srun, scontrol) to use this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    @classmethod
    def start(cls, root: str | os.PathLike, *, timeout_s: float = 60.0) -> PrivateSlurm:
        missing = [n for n in REQUIRED if _sbin(n) is None]
        if missing:
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
        root = Path(root).resolve()
        for sub in ("munge", "state", "log", "spool", "jobs"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # job steps write in jobs/; munged wants no group/other write on its dirs
        os.chmod(root / "munge", 0o700)
        os.chmod(root / "jobs", 0o777 | 0o1000)
        self = cls(root=root, conf=root / "slurm.conf")
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["scontrol", "ping"]) and "UP" in self._out(["scontrol", "ping"]), timeout_s, "slurmctld to answer")
            for node in NODES:
                self._spawn(f"slurmd-{node}", [_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait(self._nodes_idle, timeout_s, "both slurmd nodes to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    # -- daemons ---------------------------------------------------------------------------
    def _start_munge(self) -> None:
        d = self.root / "munge"
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        args = [_sbin("munged"), "-F", f"--socket={d / 'munge.sock'}", f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"]
        if os.geteuid() == 0:
            args.append("--force")  # munged refuses root without it
        self._spawn("munged", args)
        self._wait(lambda: (d / "munge.sock").exists(), 15, "munged's socket")

    def _spawn(self, name: str, argv: list) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        env = {**self.env}
        self.procs[name] = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()

    def _write_conf(self) -> None:
        r = self.root
        user = getpass.getuser()
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={CPUS_PER_NODE} "
            f"RealMemory=2048 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN" for n in NODES
        )
        self.conf.write_text(f"""\
ClusterName=dtraintest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / 'munge' / 'munge.sock'},cred_expire=5
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        # Stand-in device files: SLURM hands them out by index (CUDA_VISIBLE_DEVICES) and, with
        # task/none, never opens them.
        (r / "dev").mkdir(exist_ok=True)
        for i in range(GPUS_PER_NODE):
            (r / "dev" / f"fakegpu{i}").touch()
        (r / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={r / 'dev'}/fakegpu[0-{GPUS_PER_NODE - 1}]\n"
        )
        for n in NODES:
            (r / "spool" / n).mkdir(exist_ok=True)

    # -- waiting -----------------------------------------------------------------------------
    def _out(self, argv: list[str]) -> str:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return r.stdout + r.stderr

    def _ok(self, argv: list[str]) -> bool:
        try:
            return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _nodes_idle(self) -> bool:
        out = self._out(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{dead[0]} exited with status {self.procs[dead[0]].returncode}: {self.log_tail(dead[0])}")
            if ready():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"timed out after {timeout_s:.0f} s waiting for {what}: {self.log_tail('slurmctld')}")

    def log_tail(self, name: str, lines: int = 5) -> str:
        texts = []
        for f in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if f.exists():
                texts += f.read_text(errors="replace").splitlines()[-lines:]
        return " | ".join(texts) or "(no log)"

    # -- the end -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, then end the daemons this object started (slurmd first)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._ok(["scancel", "--full", "--quiet", "--partition", "debug"]) if _sbin("scancel") else None
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()

    def __enter__(self) -> PrivateSlurm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
