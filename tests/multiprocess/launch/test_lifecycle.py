"""The launcher's life cycle: workers die with it, stop signals end a job promptly and quietly,
a worker's error reaches the user once, and a one-node run listens on loopback only."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess

import psutil
import pytest

from dtrain.launch.supervise import Supervisor
from tests.paths import TESTS
from tests.support import run_cli
from tests.support.procs import LaunchedJob

SCRIPTS = os.path.join(str(TESTS), "scripts")
FOREVER = os.path.join(SCRIPTS, "allreduce_forever.py")
LAUNCHERS = ["torchrun", "spawn"]


def _start_forever(tmp_path, launcher: str, prefix: tuple[str, ...] = ()) -> LaunchedJob:
    job = LaunchedJob(["run", "-n", "2", "--launcher", launcher, FOREVER], out_dir=str(tmp_path), env={"READY_DIR": str(tmp_path)}, prefix=prefix)
    try:
        job.wait_for(lambda: len(glob.glob(str(tmp_path / "ready-*"))) == 2, timeout=120)
    except BaseException:
        job.kill_all()
        raise
    return job


def _no_noise(stderr: str) -> None:
    for word in ("Traceback", "frame #", "KeyboardInterrupt", "SignalException"):
        assert word not in stderr, stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_kill_9_of_the_launcher_leaves_no_worker(tmp_path, launcher):
    with _start_forever(tmp_path, launcher) as job:
        workers = job.descendants()
        assert len(workers) >= 2
        job.signal(signal.SIGKILL)
        assert job.wait(timeout=30)[0] == -signal.SIGKILL
        alive = job.survivors(after_s=5)
        assert alive == [], [p.cmdline() for p in alive]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigint_stops_with_one_line(tmp_path, launcher):
    with _start_forever(tmp_path, launcher) as job:
        job.signal(signal.SIGINT)
        rc, _ = job.wait(timeout=60)
        alive = job.survivors(after_s=5)
        assert alive == [], [p.cmdline() for p in alive]
        err = job.stderr()
    assert rc == 130, err
    _no_noise(err)
    assert err.strip().splitlines() == ["dtrain: stopped by SIGINT."]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    args = ["train", "-n", "2", "--task", "synthetic", "--task-arg", "samples=20000", "--task-arg", "hidden=32",
            "--epochs", "100", "--log-every", "5", "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt)]
    with LaunchedJob(args, out_dir=str(tmp_path)) as job:
        job.wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=180)
        job.signal(signal.SIGTERM)
        rc, _ = job.wait(timeout=60)
        alive = job.survivors(after_s=5)
        assert alive == [], [p.cmdline() for p in alive]
        err = job.stderr()
    assert rc == 128 + signal.SIGTERM, err
    _no_noise(err)
    # The workers stopped on their own at a log interval (the launcher did not have to kill
    # them after its grace period) and saved where they stopped.
    assert err.strip().splitlines()[-1] == "dtrain: stopped by SIGTERM.", err
    assert "preemption: SIGTERM received" in err
    assert glob.glob(str(ckpt / "step-*")), err


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_worker_leads_a_session_of_its_own(tmp_path, launcher):
    # As torchrun's workers do: the scheduler's autogroups then give each worker a session's
    # share of a loaded machine, not one share for all of them (lifecycle.own_session).
    script = tmp_path / "session.py"
    script.write_text(
        "import os, sys\n"
        f"open(os.path.join({str(tmp_path)!r}, 'sid-' + os.environ['RANK']), 'w').write(f'{{os.getsid(0)}} {{os.getpid()}}')\n"
    )
    out = run_cli(["run", "-n", "2", "--launcher", launcher, str(script)], timeout=150)
    assert out.returncode == 0, out.stderr
    pairs = [(tmp_path / f"sid-{r}").read_text().split() for r in range(2)]
    assert all(sid == pid for sid, pid in pairs), pairs
    assert pairs[0][0] != pairs[1][0]


@pytest.mark.timeout(300)
def test_a_script_that_ends_right_after_a_collective_exits_cleanly(tmp_path):
    # gloo's worker thread lets go of a finished all_reduce, and of its tensor, after the caller's
    # wait() returned, and that takes the GIL; a rank that ended at once could reach the
    # interpreter's finalization first, and Python's ending of the thread aborted the process
    # ("terminate called without an active exception"; 6 of 20 runs of this script here before
    # run_worker let the threads settle, 0 of 40 after). Four runs: each had a ~30% chance to abort.
    script = tmp_path / "last_collective.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1000)\n"
        "for _ in range(20):\n"
        "    dist.all_reduce(t)\n"
    )
    for _ in range(4):
        out = run_cli(["run", "-n", "2", str(script)], timeout=120)
        assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_worker_exception_is_shown_once_with_its_rank(tmp_path, launcher):
    script = tmp_path / "boom.py"
    script.write_text(
        "import torch, dtrain\n"
        "ctx = dtrain.init()\n"
        "ctx.all_reduce(torch.ones(1))\n"
        "def step():\n"
        "    raise ValueError('boom on rank 1')\n"
        "if ctx.rank == 1:\n"
        "    step()\n"
        "ctx.all_reduce(torch.ones(1))\n"
    )
    out = run_cli(["run", "-n", "2", "--launcher", launcher, str(script)], timeout=150)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("Traceback") == 1, out.stderr
    assert out.stderr.count("ValueError: boom on rank 1") == 1, out.stderr
    assert "dtrain: worker rank 1 raised:" in out.stderr
    assert 'boom.py", line 5, in step' in out.stderr  # the user's frames, not the launcher's
    assert "runpy" not in out.stderr and "lifecycle.py" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "dtrain: error: worker rank 1 failed with ValueError; its traceback is above."


@pytest.mark.timeout(180)
def test_user_error_in_a_worker_stays_one_line(tmp_path):
    script = tmp_path / "typo.py"
    script.write_text("import dtrain\ndtrain.init(strategy='fdsp')\n")
    out = run_cli(["run", "-n", "2", str(script)], timeout=150)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "dtrain: error: unknown strategy 'fdsp'; choose one of: composed, ddp, dp, fsdp, hsdp, hvd, pipeline, single, zero1."
    ]


def _public_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _hosts_prefix(tmp_path) -> tuple[str, ...]:
    """Run the job where this host's name resolves to a non-loopback address (a private mount
    namespace with its own /etc/hosts); () where that cannot be arranged (not root, no unshare)."""
    addr = _public_ipv4()
    if os.geteuid() != 0 or not shutil.which("unshare") or addr is None:
        return ()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return ()
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_one_node_run_listens_on_loopback_only(tmp_path, launcher):
    prefix = _hosts_prefix(tmp_path)
    with _start_forever(tmp_path, launcher, prefix) as job:
        if prefix:  # the job really sees its host name resolve elsewhere
            pid = str(job.proc.pid)
            resolved = subprocess.run(["nsenter", "-t", pid, "-m", "getent", "hosts", socket.gethostname()], capture_output=True, text=True)
            assert not resolved.stdout.startswith("127."), resolved.stdout
        listening = []
        for p in [psutil.Process(job.proc.pid), *job.descendants()]:
            try:
                conns = p.net_connections(kind="inet")
            except psutil.NoSuchProcess:  # a short-lived helper process (not a worker) already gone
                continue
            listening += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 3, listening  # the store, and each worker's gloo listener
    assert all(ip == "127.0.0.1" for _, ip, _ in listening), listening


@pytest.mark.timeout(180)
def test_dtrain_train_worker_exception_is_shown_once(tmp_path):
    (tmp_path / "boomtask.py").write_text(
        "import os, torch\n"
        "from torch.utils.data import TensorDataset\n"
        "class Boom(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        if os.environ['RANK'] == '1':\n"
        "            raise ValueError('bad batch on rank 1')\n"
        "        return super().forward(x)\n"
        "def make(data_dir=None):\n"
        "    x = torch.randn(64, 4); y = (x.sum(1) > 0).long()\n"
        "    return {'build_model': lambda: Boom(4, 2), 'train_set': TensorDataset(x, y), 'batch_size': 8, 'epochs': 1}\n"
    )
    out = run_cli(["train", "-n", "2", "--task", "boomtask:make"], timeout=150, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("Traceback") == 1 and out.stderr.count("ValueError: bad batch on rank 1") == 1, out.stderr
    assert "dtrain: worker rank 1 raised:" in out.stderr and 'boomtask.py", line 6, in forward' in out.stderr
    _no_noise(out.stderr.replace("Traceback", "", 1))


def test_a_killed_launchers_folder_is_removed_by_the_next_launch():
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"dtrain-launch-{dead.pid}-")
    with Supervisor():
        assert not os.path.exists(stale)
