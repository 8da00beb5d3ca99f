"""--nnodes MIN:MAX: parsing and validation, the rendezvous options handed to torch, and the
batch semantics on a world-size change (plain logic), and nodes that leave and join a job on
the network test bed (three namespace hosts; the 10-cycle measurement is
benchmarks/elastic_cycles.py)."""

from __future__ import annotations

import pytest

from dtrain.cli.common import parse_nnodes
from dtrain.errors import ConfigError, LaunchError
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
    assert opts["rdzv_backend"] == "dtrain-c10d" and opts["run_id"] == "job7" and opts["rdzv_endpoint"] == "192.0.2.1:29500"
    assert opts["rdzv_configs"]["join_timeout"] == 90 and opts["rdzv_configs"]["last_call_timeout"] == 3
    assert opts["rdzv_configs"]["is_host"] is False  # 192.0.2.1 (TEST-NET) is no address of this host
    assert _rdzv_options(LaunchSpec(nproc=2), 0)["rdzv_backend"] == "static"


def test_a_stopped_node_leaves_the_rendezvous_without_closing_it():
    """The launcher of a node told to stop replaces the handler's shutdown (which torch's
    launcher calls on its way out, and which would close the rendezvous for every node) with a
    leave: torch's own exit op on the shared state, then no more heartbeats."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    from dtrain.launch import membership

    assert membership.register() == membership.register() == "dtrain-c10d"

    class Handler:
        def __init__(self):
            self.ops, self.heartbeats, self.closed = [], True, False
            self._op_executor = self

        def run(self, op, deadline):
            self.ops.append(type(op))

        def _stop_heartbeats(self):
            self.heartbeats = False

        def shutdown(self):
            self.closed = True

    handler = membership._handler = Handler()
    try:
        membership.leave_when_shut_down()
        assert handler.shutdown() is True
        assert handler.ops == [_RendezvousExitOp] and not handler.heartbeats and not handler.closed
    finally:
        membership.forget()


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


def test_a_closed_rendezvous_means_the_job_finished_without_this_node(monkeypatch, capsys):
    """Only a node whose workers finished closes a dtrain rendezvous (a failed or stopped one
    leaves), so a node that finds it closed (it was rejoining after a loss, or came late) ends
    with exit 0 and one line, not 'the elastic agent failed'."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from dtrain.launch import membership, runner

    def closed(*_args):
        raise RendezvousClosedError()

    monkeypatch.setattr(runner, "_run_agent", closed)
    spec = LaunchSpec(nnodes=1, max_nodes=2, master_addr="127.0.0.1", master_port=29799)
    assert runner._elastic(spec, "print", ()) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dtrain: the job finished on the other node(s) while this node was joining"), err
    assert membership.finished_without_this_node(RendezvousClosedError())
    assert not membership.finished_without_this_node(RuntimeError("wait timeout"))

    def timeout(*_args):
        raise RuntimeError("Timed out waiting for MIN nodes")

    monkeypatch.setattr(runner, "_run_agent", timeout)
    with pytest.raises(LaunchError, match="the elastic agent failed: RuntimeError"):
        runner._elastic(spec, "print", ())
