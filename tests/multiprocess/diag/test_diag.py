"""Diagnostics: the stall watchdog, the collective checker, pre-launch checks and dtrain doctor."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.diag.watchdog import STALL_EXIT
from tests.paths import TESTS
from tests.support import DistributedTestError, run_cli, run_distributed

STALL = TESTS / "scripts" / "stall.py"
ALLREDUCE = TESTS / "scripts" / "allreduce.py"


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(STALL.read_text().splitlines(), 1) if marker in line)


@pytest.mark.slow
def test_sleeping_rank_is_named_with_its_line(tmp_path):
    timeout = 5
    r = run_cli(["run", "-n", "2", "--stall-timeout", str(timeout), "--run-dir", str(tmp_path), str(STALL), "sleep", "1"], timeout=120)
    ended = time.time()
    assert r.returncode == STALL_EXIT, r.stderr[-2000:]
    slept = float(re.search(r"sleeping since ([0-9.]+)", r.stdout).group(1))
    assert ended - slept <= timeout + 15, f"report took {ended - slept:.1f} s"
    assert f"rank 1 at stall.py:{_line_of('THE STALL LINE')}" in r.stderr
    assert "rank 0 waiting in all_reduce(mean)" in r.stderr and f"stall.py:{_line_of('THE ALL-REDUCE LINE')}" in r.stderr
    assert "stopped by the stall watchdog" in r.stderr
    report = (tmp_path / "stall-report.txt").read_text()
    assert "rank 1 at stall.py" in report
    dump = (tmp_path / "stall-rank1.txt").read_text()
    assert "time.sleep(3600)" in dump and "recent collectives" in dump  # stacks of every thread + history


@pytest.mark.slow
def test_max_restarts_turns_a_stall_into_a_restart(tmp_path):
    r = run_cli(["run", "-n", "2", "--max-restarts", "1", "--stall-timeout", "4", "--run-dir", str(tmp_path), str(STALL),
                 "sleep-once", "1"], timeout=150)
    assert "dtrain: stall:" in r.stderr and "rank 1 at stall.py" in r.stderr  # the first attempt stalled...
    assert r.returncode == 0 and "finished" in r.stdout, r.stderr[-2000:]  # ...and the restarted job completed


def test_skipped_all_reduce_is_reported_as_mismatch():
    t0 = time.monotonic()
    r = run_cli(["run", "-n", "2", "--debug", "--stall-timeout", "60", str(STALL), "skip", "1"], timeout=120)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 45
    assert "ranks disagree on collective" in r.stderr
    assert re.search(rf"rank 0: all_reduce\(mean\) float32\[1\] at stall.py:{_line_of('THE ALL-REDUCE LINE')}", r.stderr)
    assert "rank 1: backward (gradient all-reduce)" in r.stderr
    assert "Traceback" not in r.stderr  # one clear message per rank, not a traceback


def _setup_with_seed_per_rank() -> None:
    ctx = dtrain.init("ddp", debug=True, stall_timeout=0)
    torch.manual_seed(ctx.rank)  # a bug: every rank builds a different model
    ctx.setup(torch.nn.Linear(4, 2))


def _loader_with_rank_sized_data() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    ctx = dtrain.init("ddp", debug=True, stall_timeout=0)
    ctx.setup_dataloader(DataLoader(TensorDataset(torch.zeros(10 + ctx.rank, 2)), batch_size=2))


def test_setup_checks_parameters_and_dataset_length():
    with pytest.raises(DistributedTestError, match=r"CollectiveMismatch: ranks disagree on the parameter checksum at setup \(rank 0: .*rank 1: "):
        run_distributed(_setup_with_seed_per_rank, world_size=2, timeout=60)
    with pytest.raises(DistributedTestError, match=r"dataset length \(rank 0: 10, rank 1: 11\)"):
        run_distributed(_loader_with_rank_sized_data, world_size=2, timeout=60)


def _slow_start_and_uneven_lines(run_dir: str) -> list[float]:
    ctx = dtrain.init("ddp", debug=True, stall_timeout=2, run_dir=run_dir)
    time.sleep(5)  # loading data for longer than the timeout before training starts: no stall
    t = torch.tensor([float(ctx.rank)])
    if ctx.rank == 0:  # one collective, reached from two different lines: not a mismatch
        ctx.broadcast(t, src=0)
    else:
        ctx.broadcast(t, src=0)
    ctx.close()
    return t.tolist()


def test_no_false_alarms_before_training_or_for_different_lines(tmp_path):
    assert run_distributed(_slow_start_and_uneven_lines, str(tmp_path), world_size=2, timeout=90) == [[0.0], [0.0]]
    assert not list(tmp_path.iterdir())  # no stall dump


def _init_with_another_torch_on_rank_1() -> None:
    import dtrain.world.group

    if os.environ["RANK"] == "1":  # as if this rank's node had another torch installed
        real = dtrain.world.group.versions
        dtrain.world.group.versions = lambda: {**real(), "torch": "2.12.1", "host": "nodeb"}
    dtrain.init("ddp", stall_timeout=0).close()


def test_ranks_with_different_torch_versions_fail_at_init():
    # `dtrain run` compares nodes before starting workers (above); torchrun or srun jobs are
    # checked by dtrain.init.
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=rf"LaunchError: ranks run different torch versions: rank 1 \(nodeb\) has 2.12.1, "
                       rf"rank 0 \(.*\) has {re.escape(torch.__version__)}; install the same version"):
        run_distributed(_init_with_another_torch_on_rank_1, world_size=2, timeout=60)
    assert time.monotonic() - t0 < 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_started_with_different_world_sizes_fail_fast():
    port = _free_port()
    cmd = [sys.executable, "-m", "dtrain", "run", "-n", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # Fast: before the rendezvous's own timeout (120 s); the 60 s bounds below fail the test if a node waits for it.
    node0 = subprocess.Popen([*cmd, "--nnodes", "2", "--node-rank", "0", str(ALLREDUCE)], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        r = run_cli(["run", "-n", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--nnodes", "3",
                     "--node-rank", "1", str(ALLREDUCE)], timeout=60)
        err0 = node0.communicate(timeout=60)[1]
    finally:
        node0.kill()
    assert r.returncode == 1 and "nodes disagree on the job's size" in r.stderr
    assert node0.returncode == 1 and "--nnodes 3 -n 1 (world size 3)" in err0


_NODE_WITH_OTHER_TORCH = """
import sys
import dtrain.launch.preflight as pre
real = pre.node_view
pre.node_view = lambda spec: {**real(spec), "torch": "2.12.1", "host": "nodeb"}
from dtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_nodes_with_different_torch_versions_fail_before_any_worker_starts():
    port = _free_port()
    flags = ["run", "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(Path(dtrain.__file__).resolve().parents[1])}
    t0 = time.monotonic()
    node0 = subprocess.Popen([sys.executable, "-m", "dtrain", *flags, "--node-rank", "0", str(ALLREDUCE)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        time.sleep(1)
        node1 = subprocess.run([sys.executable, "-c", _NODE_WITH_OTHER_TORCH, *flags, "--node-rank", "1", str(ALLREDUCE)],
                               capture_output=True, text=True, timeout=60, env=env)
        err0 = node0.communicate(timeout=60)[1]
    finally:
        node0.kill()
    assert time.monotonic() - t0 < 30
    for code, err in ((node0.returncode, err0), (node1.returncode, node1.stderr)):
        assert code == 1 and "nodes run different torch versions" in err and "has 2.12.1" in err, err
        assert "world=" not in err  # no worker ran


@pytest.mark.slow
def test_master_that_does_not_answer_fails_within_30_s():
    # Something accepts TCP connections on the port but never answers (a proxy, a wrong service).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        r = run_cli(["run", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(port), str(ALLREDUCE)], timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 1 and "did not answer as node 0's rendezvous store" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_doctor_passes_on_a_healthy_node():
    r = run_cli(["doctor"], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("torch", "rendezvous", "all-reduce"):
        assert re.search(rf"^PASS\s+{re.escape(name)}\b", r.stdout, re.M), r.stdout
    assert "bus bandwidth" in r.stdout and "FAIL" not in r.stdout


def test_doctor_probes_between_nodes_started_in_any_order():
    # Two "nodes" on this host, node 1 first (as SLURM or k8s may start them): node 1 waits for node 0's
    # port, then they meet in node 0's store and all-reduce over gloo. The --timeout bounds each wait
    # only; it is long because node 0 imports torch after node 1 began to wait, on a busy machine.
    port = _free_port()
    cmd = ["doctor", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "90"]
    src = str(Path(dtrain.__file__).resolve().parents[1])
    node1 = subprocess.Popen([sys.executable, "-m", "dtrain", *cmd, "--node-rank", "1"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": src})
    try:
        seen = []
        while not (seen and seen[-1].startswith("WAIT")):  # node 1 was refused and waits: only now does node 0 start
            line = node1.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        r0 = run_cli([*cmd, "--node-rank", "0"], timeout=150)
        out1 = "".join(seen) + node1.communicate(timeout=150)[0]
    finally:
        node1.kill()
    assert re.search(rf"^WAIT\s+port\s+node 1: waiting for node 0 at 127.0.0.1:{port} ", out1, re.M), out1
    assert re.search(rf"^PASS\s+port\s+127.0.0.1:{port} accepts connections", out1, re.M), out1
    for out in (r0.stdout, out1):
        assert re.search(r"^PASS\s+rendezvous\s+2 node\(s\) met", out, re.M), out
        assert re.search(r"^PASS\s+all-reduce\s+2 nodes \(gloo\): latency \d+ us .*bus bandwidth", out, re.M), out
        assert re.search(r"^FAIL\s+network\s+.*loopback", out, re.M), out  # 127.0.0.1 across nodes


def test_env_prints_versions():
    r = run_cli(["env"], timeout=60)
    assert r.returncode == 0 and f"torch {torch.__version__}" in r.stdout and "distributed backends" in r.stdout


def _collectives_body() -> dict:
    import torch.distributed as dist

    from dtrain.diag.probe import KINDS, time_collectives

    dist.init_process_group("gloo")
    out = time_collectives(torch.device("cpu"), sizes=(64, 64 << 10), reps=2)
    assert set(out) == set(KINDS)
    return out


def test_the_links_probe_times_every_collective_alike_on_every_rank():
    # (dtrain doctor --links-out, dtrain plan --measure-links): the slowest rank's medians, the same on every rank
    a, b = run_distributed(_collectives_body, world_size=2, timeout=120)
    assert a == b
    for kind, by_size in a.items():
        assert set(by_size) == {64, 64 << 10}, kind
        assert all(s > 0 for s in by_size.values()), kind
