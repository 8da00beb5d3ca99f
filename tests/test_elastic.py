"""--nnodes MIN:MAX: parsing and validation, the rendezvous options handed to torch, and the
batch semantics on a world-size change (plain logic; the node loss/rejoin runs are in
benchmarks/elastic_cycles.py)."""

from __future__ import annotations

import pytest

from dtrain.cli.common import parse_nnodes
from dtrain.errors import ConfigError
from dtrain.launch.runner import _rdzv_options
from dtrain.launch.spec import LaunchSpec
from dtrain.train.elastic import global_batch, split


def test_nnodes_is_a_count_or_min_max():
    assert parse_nnodes(None) == (1, None)
    assert parse_nnodes("2") == (2, None)
    assert parse_nnodes("1:3") == (1, 3)
    with pytest.raises(ConfigError, match="not a number of nodes or MIN:MAX"):
        parse_nnodes("1-3")


@pytest.mark.parametrize("kw, message", [
    ({"nnodes": 3, "max_nodes": 1}, "MAX below MIN"),
    ({"nnodes": 1, "max_nodes": 2}, "needs --master-addr"),
    ({"nnodes": 1, "max_nodes": 2, "master_addr": "10.0.0.1", "node_rank": 1}, "does not go with --nnodes MIN:MAX"),
    ({"nnodes": 1, "max_nodes": 2, "master_addr": "10.0.0.1", "launcher": "spawn"}, "needs --launcher torchrun"),
])
def test_elastic_spec_refuses_what_cannot_work(kw, message):
    with pytest.raises(ConfigError, match=message):
        LaunchSpec(**kw)


def test_elastic_spec_uses_the_c10d_rendezvous_on_the_first_node():
    spec = LaunchSpec(nnodes=1, max_nodes=3, master_addr="192.0.2.1", rdzv_id="job7", join_timeout=90, last_call_s=3)
    assert spec.elastic and spec.needs_launch and spec.port == 29500
    opts = _rdzv_options(spec, spec.port)
    assert opts["rdzv_backend"] == "c10d" and opts["run_id"] == "job7" and opts["rdzv_endpoint"] == "192.0.2.1:29500"
    assert opts["rdzv_configs"]["join_timeout"] == 90 and opts["rdzv_configs"]["last_call_timeout"] == 3
    assert opts["rdzv_configs"]["is_host"] is False  # 192.0.2.1 (TEST-NET) is no address of this host
    assert _rdzv_options(LaunchSpec(nproc=2), 0)["rdzv_backend"] == "static"


def test_global_batch_keeps_the_optimizer_batch_whatever_the_world_size():
    total = global_batch(16, 1, 1, 2)
    assert total == 32
    assert split(total, 2, 16) == (16, 1)  # full size: one batch per process
    assert split(total, 1, 16) == (32, 2)  # one node left: twice the share, two micro-batches
    assert split(global_batch(16, 2, 1, 2), 2, 16) == (32, 2)  # 2 processes a node, one node left
    share, k = split(48, 2, 16)  # 1:3 nodes at 2: 24 samples each, in micro-batches of at most 16
    assert share == 24 and share % k == 0 and share // k <= 16
    with pytest.raises(ConfigError, match="does not divide by world size"):
        global_batch(16, 1, 3, 4)  # 64 samples cannot be split over 3 nodes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_killed_and_restarted_the_job_shrinks_grows_and_sees_each_sample_once():
    """Two launchers on 127.0.0.1 with --nnodes 1:2: node B is killed (kill -9 of every process)
    at a random step, the survivor goes on alone, B starts again and the job grows back; both
    finish and the samples ledger is exactly-once (benchmarks/elastic_cycles.py, one job)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dtrain.launch.store import free_port

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "elastic_cycles.py"), "--jobs", "1", "--epochs", "6",
                        "--port", str(free_port()), "--timeout", "200"], capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stderr[-3000:]
    job, summary = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    assert summary["completed"] == 1 and summary["exactly_once"] == 1, job
    assert 0 <= job["steps_redone"] <= 5, job  # at most the save interval
