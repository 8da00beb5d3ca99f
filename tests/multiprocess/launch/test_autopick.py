"""`dtrain train --parallel auto --nnodes 2`: node 0 plans for the whole world, node 1 takes its pick
from the rendezvous store, and both nodes train it to the end: two agents on 127.0.0.1, on a fixed
pair of nodes and in an elastic job (--nnodes 1:2, the second node joining once the first hosts). On the
network test bed the same takes over a minute a run: benchmarks/auto_nodes.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

STEPS = 6
PICKED = "dtrain: --parallel auto: the plan picked "


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, master: str, port: int, ledger: Path) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--task", "digits", "--parallel", "auto", "--nnodes", "2", "-n", "1",
            "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port), "--max-steps", str(STEPS),
            "--log-every", "3", "--ledger", str(ledger), "--startup-timeout", "120"]


def _check_both_trained_one_pick(outs: list[tuple[int, str, str]], ledger: Path) -> str:
    """Node 0 planned and named the world; node 1 took that pick; the job trained it on both nodes."""
    (code0, out0, err0), (code1, _, err1) = outs
    assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
    line = next(x for x in err0.splitlines() if x.startswith(PICKED))
    picked = line.removeprefix(PICKED).split(" (")[0]
    assert "Planned for 2 nodes x 1 process (world 2); every node trains this pick" in line, line
    assert f"dtrain: --parallel auto: node 0's pick for 2 nodes x 1 process (world 2): {picked}; node 1 trains it." in err1, err1[-3000:]
    assert not any(x.startswith(PICKED) for x in err1.splitlines()), "node 1 planned on its own"
    result = json.loads(out0.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == STEPS and result["strategy"] == picked, result
    # rank 1 (node 1's only process) committed every step
    rank1 = (ledger / "gen00001-rank00001.jsonl").read_text().splitlines()
    assert json.loads(rank1[0])["world_size"] == 2 and [json.loads(x)["s"] for x in rank1[1:]] == list(range(1, STEPS + 1))
    return picked


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_on_loopback_train_node_0s_pick(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen(_train(rank, "127.0.0.1", port, tmp_path / "ledger"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=_env(), cwd=tmp_path)
             for rank in (0, 1)]  # node 1 starts while node 0 plans: it waits for the store, then the pick
    _check_both_trained_one_pick(_finish(procs, 200), tmp_path / "ledger")



def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_an_elastic_job_trains_the_first_nodes_pick_on_both_nodes(tmp_path):
    import time

    port = _free_port()

    def node() -> subprocess.Popen:
        argv = [sys.executable, "-m", "dtrain", "train", "--task", "digits", "--parallel", "auto", "--nnodes", "1:2", "-n", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-steps", str(STEPS), "--log-every", "3",
                "--ledger", str(tmp_path / "ledger"), "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "3",
                "--rdzv-last-call", "60", "--startup-timeout", "120"]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                env=_env(), cwd=tmp_path)

    first = node()
    try:
        deadline = time.monotonic() + 200
        while not _listens(port) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # the first node plans, then its agent hosts the rendezvous
        procs = [first, node()]
    except BaseException:
        first.kill()
        raise
    (code0, out0, err0), (code1, _, err1) = _finish(procs, 200)
    assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
    line = next(x for x in err0.splitlines() if x.startswith(PICKED))
    picked = line.removeprefix(PICKED).split(" (")[0]
    assert "kept at every size the job runs at (no re-plan when nodes leave or join)" in line, line
    assert picked in ("ddp", "zero1", "fsdp"), line  # a layout every size runs
    assert (f"dtrain: --parallel auto: the first node's pick for 2 nodes x 1 process (world 2): {picked}; kept at every "
            "size the job runs at; this node trains it.") in err1, err1[-3000:]
    result = json.loads(out0.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["strategy"] == picked, result
