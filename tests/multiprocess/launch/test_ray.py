"""--launcher ray against a real Ray cluster: a head started here (4 CPUs, on this machine's
address), `dtrain run` and `dtrain train` on it, a rank's worker and a rank's actor killed mid-run
(the job restarts every rank and resumes from its checkpoint, exactly-once per the ledger), and the
bad inputs, one line each; then a cluster of two hosts of the network test bed (a head in one, a
node joining it from the other). The launcher's own logic without a cluster: tests/logic/launch/test_ray.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dtrain.data.ledger import check_ledger, render
from tests.paths import ROOT, TESTS
from tests.support import SRC, faults, netbed, run_cli

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (pip install 'dtrain[ray]')")
#: The tests' cluster: no token authentication (its token would be this machine's ~/.ray/auth_token), no usage report.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
_HEAD = ("import sys, ray\n"
         "ctx = ray.init(num_cpus=4, include_dashboard=False)\n"
         "print(ctx.address_info['gcs_address'], flush=True)\n"
         "sys.stdin.read()\n")  # until the test closes stdin; ray.shutdown() at exit stops the cluster


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of 4 CPUs for this module's tests; its address. Always stopped after."""
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join(p for p in (SRC, str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", _HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline().strip()), daemon=True)
    reader.start()
    reader.join(180)
    try:
        if not line or not line[0]:
            pytest.fail(f"the Ray head did not start within 180 s (exit status {proc.poll()})")
        yield line[0]
    finally:
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the head's left in its session
        except ProcessLookupError:
            pass


def _train(address: str, ck, led, *extra: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(["train", "--launcher", "ray", "--ray-address", address, "-n", "2", "--checkpoint-dir", str(ck),
                    "--save-every", "4", "--ledger", str(led), "--log-every", "4", *extra],
                   cwd=str(ROOT), timeout=timeout, env={**RAY_ENV, **(env or {})})


def _result(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_train_on_ray_runs_two_ranks_and_the_ledger_is_exactly_once(ray_head, tmp_path):
    ck, led = tmp_path / "ck", tmp_path / "ledger"
    r = _train(ray_head, ck, led, "--task", "digits", "--max-steps", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    result = _result(r)
    assert result["world_size"] == 2 and result["steps"] == 8 and result["strategy"] == "ddp", result
    assert len(result["breakdown"]) == 2  # both ranks' step times reached rank 0 (stragglers are judged on them)
    report = check_ledger(str(led))
    assert report.ok and report.generations == 1 and report.steps_kept == 8, render(report)
    assert sorted(p.name for p in led.iterdir() if p.name.endswith(".jsonl")) == ["gen00001-rank00000.jsonl", "gen00001-rank00001.jsonl"]
    assert (ck / "step-00000008").is_dir()


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_on_ray_gives_the_script_its_world(ray_head):
    r = run_cli(["run", "--launcher", "ray", "--ray-address", ray_head, "-n", "2", str(TESTS / "scripts" / "allreduce.py"), "--x", "1"],
                cwd=str(ROOT), timeout=240, env=RAY_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world=2 sum=3 argv=['--x', '1']" in r.stdout, r.stdout


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_killed_9_restarts_every_rank_and_resumes_exactly_once(ray_head, tmp_path):
    ck, led = tmp_path / "ck", tmp_path / "ledger"
    # Rank 1's worker kills itself (SIGKILL) after step 6: after step 6's ledger record, before a save.
    r = _train(ray_head, ck, led, "--task", "digits", "--max-steps", "12", "--max-restarts", "1", env=faults.env(1, 6))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dtrain: worker rank 1 was killed by signal 9; restarting all 2 workers" in r.stderr, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step-00000004 at step 4" in r.stderr, r.stderr[-3000:]
    assert _result(r)["steps"] == 12
    report = check_ledger(str(led))
    # Steps 5 and 6 of the first attempt were done again after the resume: left out, not counted twice.
    assert report.ok and report.generations == 2 and report.steps_kept == 12 and report.steps_discarded == 2, render(report)


def _actor_of_rank(rank: int, run_mark: str) -> int | None:
    """The pid of the Ray actor whose worker is ``rank`` of a job whose workers carry ``run_mark``."""
    import psutil

    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("RANK") == str(rank) and env.get("DTRAIN_TEST_MARK") == run_mark and env.get("DTRAIN_LAUNCHER_PID"):
            return int(env["DTRAIN_LAUNCHER_PID"])
    return None


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_whose_ray_actor_is_killed_9_resumes_exactly_once(ray_head, tmp_path):
    ck, led, pace = tmp_path / "ck", tmp_path / "ledger", tmp_path / "pace"
    pace.write_text("0.02")  # seconds per sample: ~0.16 s a step, time to kill the actor mid-run
    mark = f"ray-actor-kill-{os.getpid()}"
    env = {**os.environ, **RAY_ENV, "DTRAIN_TEST_MARK": mark, "PYTHONPATH": os.pathsep.join((SRC, str(ROOT)))}
    cmd = [sys.executable, "-m", "dtrain", "train", "--launcher", "ray", "--ray-address", ray_head, "-n", "2",
           "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={pace}", "--batch-size", "8", "--max-steps", "16",
           "--checkpoint-dir", str(ck), "--save-every", "4", "--ledger", str(led), "--log-every", "1", "--max-restarts", "1"]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        deadline, killed = time.monotonic() + 240, None
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            rank0 = led / "gen00001-rank00000.jsonl"
            if rank0.exists() and len(rank0.read_text().splitlines()) >= 6:  # the header and 5 steps
                actor = _actor_of_rank(1, mark)
                if actor is not None:
                    os.kill(actor, signal.SIGKILL)
                    killed = actor
            time.sleep(0.1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, f"rank 1's actor was not found running (exit {proc.returncode})"
    assert proc.returncode == 0, err[-3000:]
    assert "dtrain: worker rank 1 was lost (its Ray actor or node died); restarting all 2 workers" in err, err[-3000:]
    assert "resumed from" in err, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 16
    report = check_ledger(str(led))
    assert report.ok and report.generations == 2 and report.steps_kept == 16, render(report)


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_the_driver_reaches_every_worker_which_saves_and_stops(ray_head, tmp_path):
    ck, pace = tmp_path / "ck", tmp_path / "pace"
    pace.write_text("0.02")
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join((SRC, str(ROOT)))}
    cmd = [sys.executable, "-m", "dtrain", "train", "--launcher", "ray", "--ray-address", ray_head, "-n", "2",
           "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={pace}", "--batch-size", "8", "--max-steps", "400",
           "--checkpoint-dir", str(ck), "--log-every", "5"]
    log = tmp_path / "stderr"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=f, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while "step 10/" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert not (ck / "latest").exists(), log.read_text()[-3000:]  # no save before the signal (no --save-every)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1] == "dtrain: stopped by SIGTERM.", err[-3000:]
    assert "SIGTERM received" in err and (ck / "latest").exists(), err[-3000:]  # the workers saved at their next log interval


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_rank_ends_the_job_with_the_stall_line_and_its_status(ray_head, tmp_path):
    # Rank 1 stops itself (SIGSTOP) at step 5: its watchdog is frozen too; rank 0's reports the
    # stall and exits 124, and the driver then kills every rank's actor (the stopped worker with
    # it: the launcher's stall reaper has no part under Ray).
    r = run_cli(["run", "--launcher", "ray", "--ray-address", ray_head, "-n", "2", "--stall-timeout", "5",
                 "--run-dir", str(tmp_path), str(TESTS / "scripts" / "freeze.py")], cwd=str(ROOT), timeout=240, env=RAY_ENV)
    assert r.returncode == 124, r.stderr[-3000:]
    assert "rank 1 did not answer" in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "dtrain: error: worker rank 0 was stopped by the stall watchdog (status 124); see the stall report above."), r.stderr[-3000:]


@needs_ray
@pytest.mark.timeout(300)
def test_more_workers_than_the_cluster_has_cpus_is_one_line(ray_head, tmp_path):
    r = run_cli(["train", "--launcher", "ray", "--ray-address", ray_head, "-n", "8", "--max-steps", "1"],
                cwd=str(tmp_path), timeout=240, env=RAY_ENV)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "dtrain: error: the Ray cluster cannot place -n 8 worker(s) on each of 1 node(s) (8 CPU(s) per node): it has 1 "
        "node(s) with 4 CPU(s) each; use -n 4 or fewer, or add nodes to the cluster."), r.stderr
    assert "Traceback" not in r.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_ray
@pytest.mark.timeout(120)
def test_no_cluster_at_the_address_is_one_line_at_once(tmp_path):
    port = _closed_port()
    r = run_cli(["train", "--launcher", "ray", "--ray-address", f"127.0.0.1:{port}", "-n", "2", "--max-steps", "1"],
                cwd=str(tmp_path), timeout=100, env=RAY_ENV)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"dtrain: error: no Ray cluster reachable at --ray-address 127.0.0.1:{port} (Connection refused); start its head "
        f"(`ray start --head --port {port}`) or give the address `ray start --head` printed."], r.stderr


@pytest.mark.timeout(120)
def test_launcher_ray_without_ray_installed_is_one_line_and_dtrain_imports_without_it(tmp_path):
    # sys.modules["ray"] = None: `import ray` fails and find_spec finds nothing, as where ray is not installed.
    code = ("import sys; sys.modules['ray'] = None\n"
            "import dtrain, dtrain.cli, dtrain.launch, dtrain.launch.ray_rank\n"
            "from dtrain.cli import main\n"
            f"sys.exit(main(['run', '--launcher', 'ray', '-n', '2', {str(TESTS / 'scripts' / 'allreduce.py')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": os.pathsep.join((SRC, str(ROOT)))})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "dtrain: error: --launcher ray needs the ray package, which is not installed here; pip install 'dtrain[ray]'."], r.stderr


_BED = netbed.unavailable_reason()


def _ray_node(bed, host: int, temp: str, log: str) -> subprocess.Popen:
    """``ray start --block`` on a bed host: the head on host 0, a node joining it elsewhere (each
    node its own temp folder: the hosts share this machine's /tmp). Each node is given its
    address, as a Ray cluster of several machines needs (a head left to Ray's own detection on a
    host without a default route registers 127.0.0.1, and no other node can reach it)."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    role = (["--head", "--port", "6379", "--include-dashboard=false"] if host == 0 else ["--address", f"{bed.addresses[0]}:6379"])
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join((SRC, str(ROOT)))}
    return bed.popen(host, [ray, "start", "--block", *role, "--node-ip-address", bed.addresses[host], "--num-cpus", "2",
                            "--disable-usage-stats", "--temp-dir", temp], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait_for_line(path: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and text in open(path).read():
            return
        time.sleep(0.5)
    pytest.fail(f"{text!r} not in {path} within {timeout:.0f} s:\n{open(path).read()[-2000:] if os.path.exists(path) else ''}")


@needs_ray
@pytest.mark.skipif(_BED is not None, reason=f"network test bed unavailable: {_BED}")
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shared_name", [None, "vm"], ids=["own-names", "shared-name"])
def test_a_ray_cluster_of_two_bed_hosts_runs_a_rank_on_each_and_resumes_a_lost_rank(tmp_path, shared_name):
    # shared-name: both hosts are "vm", which each host's /etc/hosts maps to 127.0.0.1 (as many
    # VMs are set up): whatever learns its address from the host name gets loopback.
    import shutil
    import tempfile

    temps = [tempfile.mkdtemp(prefix="dtr", dir="/tmp") for _ in range(2)]  # short: Ray's socket paths have a length limit
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join((SRC, str(ROOT)))}
    ck, led = tmp_path / "ck", tmp_path / "ledger"
    try:
        with netbed.NetBed(hosts=2, shared_name=shared_name) as bed:
            logs = [str(tmp_path / f"ray{i}.log") for i in range(2)]
            _ray_node(bed, 0, temps[0], logs[0])
            _wait_for_line(logs[0], "Ray runtime started", 240)
            _ray_node(bed, 1, temps[1], logs[1])
            _wait_for_line(logs[1], "Ray runtime started", 240)
            address = f"{bed.addresses[0]}:6379"
            run = bed.popen(0, [sys.executable, "-m", "dtrain", "run", "--launcher", "ray", "--ray-address", address, "-n", "1",
                                "--nnodes", "2", str(TESTS / "scripts" / "rank_host.py")], env=env, cwd=str(ROOT))
            out, _ = run.communicate(timeout=300)
            assert run.returncode == 0, out[-3000:]
            # STRICT_SPREAD: one rank on each host (either may hold rank 0: Ray picks the nodes); rank 0's node hosts the store.
            seen = dict(re.findall(r"RANK_HOST rank=(\d) host=\S+ addr=(\S+) master=\S+ sum=2", out))
            assert sorted(seen.values()) == sorted(bed.addresses), out[-3000:]
            for rank, addr in seen.items():
                name = bed.names[bed.addresses.index(addr)]
                assert f"RANK_HOST rank={rank} host={name} addr={addr} master={seen['0']} sum=2" in out, out[-3000:]
            train = bed.popen(0, [sys.executable, "-m", "dtrain", "train", "--launcher", "ray", "--ray-address", address, "-n", "1",
                                  "--nnodes", "2", "--task", "digits", "--max-steps", "12", "--checkpoint-dir", str(ck),
                                  "--save-every", "4", "--ledger", str(led), "--log-every", "4", "--max-restarts", "1"],
                              env={**env, **faults.env(1, 6)}, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = train.communicate(timeout=400)
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    assert train.returncode == 0, err[-3000:]
    assert "dtrain: worker rank 1 was killed by signal 9; restarting all 2 workers" in err and "step-00000004 at step 4" in err, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["world_size"] == 2
    report = check_ledger(str(led))
    assert report.ok and report.generations == 2 and report.steps_kept == 12 and report.steps_discarded == 2, render(report)
