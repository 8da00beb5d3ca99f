"""The step breakdown, stragglers named with their cause, and the run's observability outputs."""

from __future__ import annotations

import importlib.util
import json

import pytest

import dtrain
from dtrain.metrics.breakdown import PHASES
from tests.paths import ROOT
from tests.support import run_cli, slowdown


def _probe_body(nbytes):
    import torch.distributed as dist

    from dtrain.metrics.links import probe

    ctx = dtrain.init("ddp")
    try:
        return probe(dist.get_rank(), dist.get_world_size(), ctx.device, nbytes)
    finally:
        ctx.close()


def test_link_probe_times_every_ordered_pair_and_agrees_on_every_rank():
    from tests.support import run_distributed

    got = run_distributed(_probe_body, 65536, world_size=3, timeout=120)
    ms = got[0]
    assert all(m == ms or str(m) == str(ms) for m in got)  # the same matrix (NaN diagonal) on every rank
    assert all(ms[a][a] != ms[a][a] for a in range(3))
    assert all(0 < ms[a][b] < 10_000 for a in range(3) for b in range(3) if a != b)


def _train(tmp_path, inject=None, extra=()):
    metrics = tmp_path / "m.jsonl"
    env = slowdown.env(inject) if inject else {}
    r = run_cli(["train", "-n", "2", "--max-steps", "40", "--log-every", "10", "--straggler-window", "20",
                 "--metrics-file", str(metrics), *extra], timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    return r, json.loads(r.stdout.strip().splitlines()[-1]), [json.loads(x) for x in metrics.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("inject, cause", [("1:input:40", "input"), ("1:compute:40", "compute")])
def test_two_ranks_name_the_slowed_rank_and_its_cause(tmp_path, inject, cause):
    r, result, records = _train(tmp_path, inject)
    lines = [x for x in r.stderr.splitlines() if "straggler:" in x]
    assert len(lines) == 1 and "straggler: rank 1 " in lines[0], r.stderr
    assert {(s["rank"], s["cause"]) for s in result["stragglers"]} == {(1, cause)}
    assert any("stragglers" in rec for rec in records)
    waited = result["breakdown"][0]["median_ms"]["comm"]  # rank 0 waits for rank 1 in its all-reduce
    assert waited > 20, result["breakdown"]


@pytest.mark.slow
def test_healthy_two_rank_run_names_no_straggler_and_records_the_breakdown(tmp_path):
    # hidden=1024: a step of ~20 ms, not digits' default ~2.6 ms, where the 2 ranks on CI's 2 cores beside the
    # launcher differed by 1 ms (1.3x, so named: CI of stop 36) though nothing was wrong with either.
    # --straggler-threshold 2: on this virtual machine one core computes up to 1.2-1.4x slower than its sibling
    # while both are busy (benchmarks/cores_at_once.py), and a CI run (stop 43) named rank 1 at 1.5x for 29
    # steps: a real difference between the cores, which the default 1.3 rightly reports; healthy here is < 2x
    r, result, records = _train(tmp_path, extra=("--task-arg", "hidden=1024", "--straggler-threshold", "2"))
    assert "straggler" not in r.stderr and result["stragglers"] == []
    assert [len(rec["breakdown"]) for rec in records] == [2, 2, 2, 2]
    for rank in result["breakdown"]:
        assert set(rank["median_ms"]) == {*PHASES, "step", "own"} and rank["steps"] == 39
        assert rank["median_ms"]["backward"] > 0 and rank["p90_ms"]["step"] >= rank["median_ms"]["step"]


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (the 'tensorboard' extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    r = run_cli(["train", "-n", "2", "--max-steps", "20", "--log-every", "10", "--tensorboard", str(tb)], timeout=180)
    assert r.returncode == 0, r.stderr
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "comm/bytes_per_step", "breakdown/forward_ms/rank0",
            "breakdown/comm_ms/rank1", "memory/peak_mib/rank1"} <= tags, tags
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20]
    from dtrain.tasks import load_task

    assert acc.Scalars("train/lr")[0].value == pytest.approx(load_task("digits").lr)  # the task's default
    assert all(e.value > 0 for e in acc.Scalars("comm/bytes_per_step"))


def test_trace_merges_every_rank_on_rank_zeros_clock(tmp_path):
    trace = tmp_path / "t" / "trace.json"
    r = run_cli(["train", "-n", "2", "--max-steps", "8", "--log-every", "4", "--trace", "3:6", "--trace-file", str(trace),
                 "--metrics-file", str(tmp_path / "t" / "metrics.jsonl")], timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert {e["pid"] for e in spans} == {0, 1} and {e["args"]["step"] for e in spans} == {3, 4, 5}
    assert {"data_wait", "forward", "backward", "comm", "optimizer"} <= {e["name"] for e in spans}
    other = doc["otherData"]
    assert set(other["clock_offsets_us"]) == {"0", "1"} and other["clock_offsets_us"]["0"] == 0.0
    assert other["clock_error_bound_us"]["1"] > 0 and "NTP" in other["clock_method"]
    for pid in (0, 1):  # a rank's spans follow each other on its own (aligned) clock
        mine = [e for e in spans if e["pid"] == pid]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(mine, mine[1:]))  # float sums only
        # Each step's gradient bucket (one: the digits model is small) is all-reduced from inside
        # backward to the end of its exposed communication, on the collectives' track.
        buckets = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 1 and e["pid"] == pid and "bucket" in e["name"]]
        assert [(e["name"], e["args"]["step"]) for e in buckets] == [("all_reduce bucket 0", s) for s in (3, 4, 5)]
        for b in buckets:
            step = b["args"]["step"]
            phase = {e["name"]: e for e in mine if e["args"]["step"] == step}
            # The profiler's events reach the breakdown's clock through one mark, so allow 5 ms of
            # slack. The bucket starts inside backward..comm; its recorded end may lag the real one on
            # a loaded machine (1.1 ms, and once 5.2 ms, past comm's end: the profiler records it from
            # the collectives' thread), so it is held to the order of steps: done before the next
            # step's forward.
            slack = 5000.0
            assert phase["backward"]["ts"] - slack <= b["ts"] <= phase["comm"]["ts"] + phase["comm"]["dur"] + slack
            nxt = [e for e in mine if e["args"]["step"] == step + 1 and e["name"] == "forward"]
            assert not nxt or b["ts"] + b["dur"] <= nxt[0]["ts"] + slack
    if importlib.util.find_spec("matplotlib"):  # `dtrain report` draws the trace found in the run's folder
        from dtrain.metrics.report import render

        paths = render(str(trace.parent))
        with open(paths["timeline"], "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert "![timeline](timeline.png)" in open(paths["markdown"]).read()


def _bed_reason():
    from tests.support import netbed

    return netbed.unavailable_reason()


_BED = _bed_reason()


@pytest.mark.skipif(_BED is not None, reason=f"network test bed unavailable: {_BED}")
@pytest.mark.timeout(240)
def test_three_hosts_name_the_host_whose_link_is_slow_with_cause_network(tmp_path):
    import os
    import sys

    from tests.support import netbed

    src = os.path.join(str(ROOT), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    env.pop("DTRAIN_SLOW_INJECT", None)
    # 2 Mbit/s: communication dominates the step even where the CPU is shared with other jobs.
    with netbed.NetBed(hosts=3, links={2: netbed.Link(rate_mbit=2)}) as bed:
        outs = bed.run_nodes(lambda rank, master: [
            sys.executable, "-m", "dtrain", "train", "--task", "digits", "--max-steps", "20", "--log-every", "5",
            "--straggler-window", "10", "--nnodes", "3", "--node-rank", str(rank), "--master-addr", master,
            "--master-port", "29531"], timeout=200, env=env)
    assert [o.returncode for o in outs] == [0, 0, 0], "\n".join(o.output[-3000:] for o in outs)
    result = json.loads(next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{")))
    network = [s for s in result["stragglers"] if s["cause"] == "network"]
    assert network and {(s["rank"], s["host"]) for s in network} == {(2, "n2")}, result["stragglers"]
    assert "straggler: rank 2 (host n2): every rank spent" in outs[0].output
