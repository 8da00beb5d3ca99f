"""Start-up waits that end (issue 51, item 2), the logic half: the start-up bound is checked where
the flags are read, a wildcard --local-addr is refused, and the pre-launch waits (node 1 for node 0,
node 0 for the others, the others for node 0's verdict) end in one line within their bound. The
CLI as a user meets it, as subprocesses: tests/multiprocess/launch/test_startup_waits.py."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import time

import pytest
import torch.distributed as dist

from dtrain.errors import ConfigError, LaunchError
from dtrain.launch import preflight
from dtrain.launch.spec import LaunchSpec
from dtrain.options import Startup
from dtrain.world.reach import check_not_wildcard
from tests.logic.cli import test_bad_inputs as base

fixtures, _one_line = base.fixtures, base._one_line


def _cli(argv: list[str]) -> int:
    from dtrain.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return exc.code


@pytest.mark.parametrize("flag, value", [
    ("--startup-timeout", "1e-9"), ("--startup-timeout", "0.5"), ("--startup-timeout", "0"), ("--startup-timeout", "-3"),
    ("--startup-timeout", "nan"), ("--startup-timeout", "inf"), ("--rdzv-timeout", "0.5"), ("--rdzv-timeout", "1e-9"),
])
@pytest.mark.parametrize("command", [["run", "-n", "2"], ["train", "--task", "synthetic", "-n", "2"]])
def test_a_start_up_bound_below_a_second_is_refused_as_the_flags_are_read(fixtures, capsys, command, flag, value):
    argv = [*command, flag, value, *(["ok.py"] if command[0] == "run" else [])]
    assert _cli(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"dtrain: error: argument {flag}: it must be a finite number of seconds >= 1, got "), line
    assert "e.g. 120" in line


def test_a_start_up_bound_of_a_second_or_more_is_taken(fixtures, capsys):
    from dtrain.cli import build_parser

    args = build_parser().parse_args(["run", "--startup-timeout", "1", "--rdzv-timeout", "2.5", "ok.py"])
    assert (args.startup_timeout, args.rdzv_timeout) == (1.0, 2.5)


def test_the_spec_and_the_variable_hold_the_same_minimum():
    for bad in (1e-9, 0.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--startup-timeout must be a finite number of seconds >= 1"):
            LaunchSpec(startup_timeout=bad)
    with pytest.raises(ConfigError, match="--rdzv-timeout must be a finite number of seconds >= 1, got 0.5"):
        LaunchSpec(nnodes=1, max_nodes=2, master_addr="127.0.0.1", join_timeout=0.5)
    with pytest.raises(ConfigError, match="DTRAIN_STARTUP_TIMEOUT must be a finite number of seconds >= 1, got 1e-09"):
        Startup.from_env({"DTRAIN_STARTUP_TIMEOUT": "1e-9"})
    assert Startup.from_env({"DTRAIN_STARTUP_TIMEOUT": "0"}).timeout is None  # 0: the default bound
    assert Startup.from_env({"DTRAIN_STARTUP_TIMEOUT": "30"}).timeout == 30.0


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "[::]", "0"])
def test_a_wildcard_local_address_is_refused(addr):
    with pytest.raises(ConfigError, match=r"is a wildcard address \(every interface\), not one the other nodes can reach"):
        check_not_wildcard("--local-addr", addr)
    check_not_wildcard("--local-addr", "127.0.0.1")  # a real one passes


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_the_cli_refuses_a_wildcard_local_address_before_anything_starts(fixtures, capsys, nnodes):
    argv = ["run", "-n", "1", "--nnodes", nnodes, "--master-addr", "127.0.0.1", "--local-addr", "0.0.0.0", "ok.py"]
    assert _cli(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("dtrain: error: --local-addr 0.0.0.0 is a wildcard address") and "ip -brief addr" in line, line


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def said(monkeypatch):
    """dtrain's progress lines, the first one after 0.3 s rather than 3 s."""
    monkeypatch.setattr(preflight, "FIRST_NOTE_S", 0.3)
    handler, log = _Said(), logging.getLogger("dtrain")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.mark.timeout(60)
def test_node_1_waits_for_node_0_up_to_the_bound_then_says_so(said):
    port = _closed_port()
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        preflight.wait_for_master("127.0.0.1", port, timeout_s=1.5, me="node 1")
    took = time.monotonic() - start
    assert str(err.value) == (f"node 1 could not connect to node 0 at 127.0.0.1:{port} within 1.5 s: connection refused "
                              "(nothing listens there); start node 0 (--node-rank 0) there with the same --master-addr "
                              "and --master-port, or raise --startup-timeout.")
    assert 1.5 <= took < 10
    assert len(said) == 1 and said[0].startswith(f"node 1: waiting for node 0 at 127.0.0.1:{port} (")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


@pytest.mark.timeout(60)
def test_node_0_waits_for_a_missing_node_up_to_the_bound_and_leaves_its_verdict(said):
    server = _store()
    spec = LaunchSpec(nnodes=3, node_rank=0, master_addr="127.0.0.1", master_port=server.port)
    store = dist.PrefixStore("/dtrain/preflight", server)
    store.set("node/1", json.dumps(preflight.node_view(spec)))  # node 1 came, node 2 never does
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        preflight.check_nodes(spec, server.port, timeout_s=1.5)
    took = time.monotonic() - start
    text = str(err.value)
    assert text.startswith(f"node 0 waited 1.5 s at 127.0.0.1:{server.port} for node(s) 2 of --nnodes 3, which never connected; ")
    assert "raise --startup-timeout" in text and "\n" not in text
    assert 1.5 <= took < 10
    assert any(line.startswith(f"waiting for 1 more node(s) at 127.0.0.1:{server.port} (") and "node(s) 2 not connected yet"
               in line for line in said), said
    assert store.get("verdict").decode() == text  # what node 1 reads


@pytest.mark.timeout(60)
def test_a_node_that_came_ends_with_node_0s_verdict_instead_of_starting_its_agent():
    server = _store()
    spec = LaunchSpec(nnodes=3, node_rank=1, master_addr="127.0.0.1", master_port=server.port)
    store = dist.PrefixStore("/dtrain/preflight", server)
    store.set("node/0", json.dumps({**preflight.node_view(spec), "host": "n0"}))
    store.set("verdict", "node 0 waited 5 s at 127.0.0.1:1 for node(s) 2 of --nnodes 3, which never connected; start ...")
    with pytest.raises(LaunchError, match=r"^node 0 waited 5 s at 127\.0\.0\.1:1 for node\(s\) 2 of --nnodes 3"):
        preflight.check_nodes(spec, server.port, timeout_s=5)
    store.set("verdict", "ok")
    preflight.check_nodes(spec, server.port, timeout_s=5)  # node 0 saw every node: go on


def test_progress_lines_come_at_a_modest_rate():
    notes = preflight.Notes()
    due = [t for t in range(0, 125) if notes.due(float(t))]
    assert due == [3, 33, 63, 93, 123]
