"""`--parallel auto --nnodes N`'s hand-off (launch/autopick.py) on a real TCPStore on 127.0.0.1 in
this process, two 'nodes' as threads: node 0 posts its pick as its store opens, node 1 reads the
same pick; node 1 ends in one line when node 0 posts none."""

from __future__ import annotations

import threading
import time

import pytest

from dtrain.errors import DtrainError
from dtrain.launch import autopick
from dtrain.launch.spec import LaunchSpec
from dtrain.launch.store import free_port, host_store
from dtrain.train.config import ParallelConfig, TaskConfig, TrainConfig


def _cfg(**parallel) -> TrainConfig:
    return TrainConfig(task=TaskConfig(name="digits"), parallel=ParallelConfig(**parallel))


def _spec(rank: int, port: int, *, nproc: int = 1) -> LaunchSpec:
    return LaunchSpec(nproc=nproc, nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=port, startup_timeout=1.0)


def _node1(spec: LaunchSpec) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def run() -> None:
        try:
            got["cfg"] = autopick.receive(_cfg(layout="auto"), spec)
        except DtrainError as exc:
            got["error"] = str(exc)

    return threading.Thread(target=run), got


def _open_store(spec: LaunchSpec):
    store, _ = host_store(spec.addr, spec.port, timeout_s=10)
    for key, value in spec.store_values:  # as launch.runner._rendezvous opens node 0's store
        store.set(key, value)
    return store


def test_node_1_trains_the_pick_node_0_posted(capsys):
    port = free_port()
    node0 = autopick.post(_spec(0, port), _cfg(strategy="auto", layout="dp_shard=1,tp=2"))
    assert autopick.plans_here(node0) and not autopick.plans_here(_spec(1, port))
    thread, got = _node1(_spec(1, port))
    thread.start()  # node 1 first: node 0 is still planning, its store not open yet
    store = _open_store(node0)
    thread.join(timeout=30)
    del store
    assert "error" not in got, got
    assert (got["cfg"].parallel.strategy, got["cfg"].parallel.layout) == ("auto", "dp_shard=1,tp=2")
    assert ("dtrain: --parallel auto: node 0's pick for 2 nodes x 1 process (world 2): dp_shard=1,tp=2; node 1 trains it."
            in capsys.readouterr().err)


def test_node_1_ends_in_one_line_when_node_0_posts_no_pick():
    port = free_port()
    store = _open_store(_spec(0, port))  # node 0 without --parallel auto: its store opens with no pick
    thread, got = _node1(_spec(1, port))
    thread.start()
    thread.join(timeout=30)
    del store
    assert got.get("error") == (
        f"node 0's rendezvous store at 127.0.0.1:{port} holds no --parallel auto pick after 1 s (key dtrain/auto_pick/dtrain); "
        "start node 0 with --parallel auto too (it plans for every node), or give every node the same --strategy/--parallel."), got


def test_node_1_ends_in_one_line_when_node_0s_store_closes_before_a_pick(monkeypatch):
    connected, wait = threading.Event(), autopick.wait_for_pick
    monkeypatch.setattr(autopick, "wait_for_pick", lambda *a, **k: (connected.set(), wait(*a, **k))[1])
    port = free_port()
    store = _open_store(_spec(0, port))  # node 0 without --parallel auto, which gives up and ends
    spec = LaunchSpec(nproc=1, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port, startup_timeout=30.0)
    thread, got = _node1(spec)
    thread.start()
    assert connected.wait(timeout=30)  # node 1 is connected to the store and polls it
    time.sleep(0.3)
    del store
    thread.join(timeout=60)
    assert got.get("error") == (f"node 0's rendezvous store at 127.0.0.1:{port} closed before it held a --parallel auto pick; "
                                "see node 0's output, and start every node with --parallel auto."), got


def test_a_node_started_with_another_world_is_refused():
    port = free_port()
    store = _open_store(autopick.post(_spec(0, port, nproc=2), _cfg(strategy="ddp")))
    thread, got = _node1(_spec(1, port, nproc=1))
    thread.start()
    thread.join(timeout=30)
    del store
    assert got.get("error", "").startswith("node 0 planned --parallel auto for 2 nodes x 2 processes (world 4), but this node "
                                           "was started with --nnodes 2 -n 1"), got


def test_one_node_posts_nothing():
    spec = LaunchSpec(nproc=2)
    assert autopick.post(spec, _cfg(strategy="ddp")).store_values == ()


def test_the_pick_reads_back_as_it_was_written():
    pick = autopick.Pick(strategy="auto", layout="dp_shard=2,tp=2", nnodes=2, nproc=2)
    assert autopick.Pick.from_json(pick.to_json()) == pick
    with pytest.raises(TypeError):
        autopick.Pick.from_json('{"strategy": "ddp"}')


def test_an_elastic_jobs_first_node_plans_for_max_and_a_joiner_takes_the_pick(capsys):
    port = free_port()

    def elastic() -> LaunchSpec:
        return LaunchSpec(nproc=1, nnodes=1, max_nodes=3, master_addr="127.0.0.1", master_port=port, startup_timeout=1.0)

    first = elastic()
    assert autopick.plans_here(first) and autopick.planned_nodes(first) == 3  # nobody listens yet: this node will host
    first = autopick.post(first, _cfg(strategy="fsdp"))
    store = _open_store(first)
    assert not autopick.plans_here(elastic())  # the endpoint is taken: a joiner
    thread, got = _node1(elastic())
    thread.start()
    thread.join(timeout=30)
    del store
    assert got["cfg"].parallel.strategy == "fsdp", got
    assert ("dtrain: --parallel auto: the first node's pick for 3 nodes x 1 process (world 3): fsdp; kept at every size "
            "the job runs at; this node trains it.") in capsys.readouterr().err


def test_node_1_waiting_for_a_planning_node_0_says_it_may_still_be_planning(monkeypatch, caplog):
    from dtrain.launch import preflight
    monkeypatch.setattr(preflight, "FIRST_NOTE_S", 0.2)
    port = free_port()  # nothing listens: node 0 is still profiling the model
    with caplog.at_level("INFO", logger="dtrain"), pytest.raises(DtrainError):
        autopick.receive(_cfg(layout="auto"), _spec(1, port))
    notes = [r.getMessage() for r in caplog.records if "waiting for node 0" in r.getMessage()]
    assert notes and "node 0 may still be planning (--parallel auto profiles the model first)" in notes[0], notes
    assert "wrong --master-addr" not in notes[0]
