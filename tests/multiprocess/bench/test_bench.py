"""dtrain bench: method selection, the figures, and the CLI end to end on a tiny task."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.bench import parse_methods
from dtrain.bench.methods import METHODS, comm_methods
from dtrain.bench.report import summarise
from dtrain.bench.runner import BenchConfig, MethodRun, worker_args
from dtrain.launch.store import free_port
from tests.support import run_cli, run_distributed

# `dtrain bench` starts each method's own processes: 15-25 s of start-up a method on 2 cores. The
# CLI test runs one method per way they are started (torch's DDP script under torchrun, one
# process, dtrain under torchrun, under spawn) and one --comm method; the other methods differ
# only in the worker's arguments, so their workers run from the arguments the runner passes, one
# after another in one 2-process spawn (the second test). Between them they run every method.
CLI_METHODS, CLI_COMMS = ("reference", "dp", "ddp", "ddp-spawn"), ("localsgd:4",)
WORKER_METHODS, WORKER_COMMS = ("ddp", "ddp-bf16", "hvd"), ("powersgd:2",)


def _check_rows(rows: list[dict]) -> dict[str, float]:
    """What every method's report row must hold; returns each method's bytes sent per step."""
    for m in rows:
        assert "error" not in m, m
        assert m["samples_per_s"] > 0 and m["test_acc"] is not None
        assert len(m["peak_mem_mib_per_rank"]) == m["processes"]
        assert (m["comm_bytes_per_step"] > 0) == (m["processes"] > 1)
    return {m["method"]: m["comm_bytes_per_step"] for m in rows}


@pytest.mark.slow
def test_bench_cli_writes_all_reports_with_each_way_of_starting_a_method(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(["bench", "--task", "digits", "--methods", ",".join(CLI_METHODS), "--steps", "3", "--repeats", "1", "--warmup", "2",
                 *(a for c in CLI_COMMS for a in ("--comm", c)), "--out", str(out)], timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "report.json").read_text())
    names = [m["method"] for m in report["methods"]]
    assert set(names) == {"single", *CLI_METHODS} | {f"ddp+{c}" for c in CLI_COMMS}
    sent = _check_rows(report["methods"])
    assert sent["ddp+localsgd:4"] == sent["ddp"] // 4
    assert report["environment"]["torch"] and report["environment"]["world_size"] == 2
    md = (out / "report.md").read_text()
    assert all(f"| {n} |" in md for n in names)
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert "| ddp-spawn |" in r.stdout  # the table is printed too


def _bench_methods() -> dict:
    return {**METHODS, **{m.name: m for m in comm_methods([*CLI_COMMS, *WORKER_COMMS], warmup=2)}}


def _workers(names: list[str], out: str, ports: list[int]) -> None:
    """Each method's bench worker in turn, with the arguments `dtrain bench` gives it; each with a
    rendezvous store of its own, as each of its launches has (a store reused by a second process
    group holds the first one's keys: the third group hung at its first barrier)."""
    from dtrain.bench import worker

    cfg = BenchConfig(task="digits", steps=3, repeats=1, warmup=2, out=out)
    for name, port in zip(names, ports):
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(port))
        worker.main(worker_args(cfg, _bench_methods()[name], os.path.join(out, name)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_workers_of_the_other_methods_write_their_records(tmp_path):
    every = {m.name for m in parse_methods(None, device="cpu")} | {f"ddp+{c}" for c in (*CLI_COMMS, *WORKER_COMMS)}
    covered = {"single", *CLI_METHODS, *WORKER_METHODS} | {f"ddp+{c}" for c in (*CLI_COMMS, *WORKER_COMMS)}
    assert every <= covered, f"bench methods no test runs: {sorted(every - covered)}; add them to CLI_METHODS or WORKER_METHODS"
    names = [*WORKER_METHODS, *(f"ddp+{c}" for c in WORKER_COMMS)]
    run_distributed(_workers, names, str(tmp_path), [free_port() for _ in names], world_size=2, timeout=280)
    rows = []
    for name in names:  # as the runner reads them: every rank's record, then the report's row
        records = [json.loads((tmp_path / name / f"rank{rank}.json").read_text()) for rank in range(2)]
        rows.append(summarise(MethodRun(method=_bench_methods()[name], nproc=2, records=[records]), None))
    assert [m["method"] for m in rows] == names
    sent = _check_rows(rows)
    assert 0 < sent["ddp+powersgd:2"] < sent["ddp"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--methods", "ddp,zzz"], "unknown bench method(s) zzz"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--task", "nope"], "unknown task 'nope'"),
    ],
)
def test_bench_bad_input_is_one_line(argv, expected, tmp_path):
    r = run_cli(["bench", "--out", str(tmp_path), *argv], timeout=60)
    assert r.returncode == 2
    assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_measures_the_speed_split_beside_ddp(tmp_path):
    # ddp+split: the worker splits by speed after its measurement and starts the measured steps
    # with the measured shares; every rank's record keeps the changes, the report says them.
    out = tmp_path / "bench"
    r = run_cli(["bench", "--task", "digits", "--methods", "ddp+split", "--steps", "2", "--repeats", "1", "--warmup", "1",
                 "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "report.json").read_text())
    row = next(m for m in report["methods"] if m["method"] == "ddp+split")
    assert "error" not in row and row["processes"] == 2 and row["samples_per_s"] > 0
    assert isinstance(row["batch_split"], list)
    ranks = [json.loads((out / "runs" / "ddp+split-round0" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["batch_split"] == ranks[1]["batch_split"] == row["batch_split"]
    assert "- `ddp+split`: " in (out / "report.md").read_text()
