"""dtrain bench: method selection, the figures, and the CLI end to end on a tiny task."""

from __future__ import annotations

import json

import pytest

from dtrain.bench import parse_methods
from tests.support import run_cli


@pytest.mark.slow
def test_bench_cli_writes_all_reports_with_every_method(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(["bench", "--task", "digits", "--steps", "3", "--repeats", "1", "--warmup", "2", "--comm", "powersgd:2",
                 "--comm", "localsgd:4", "--out", str(out)], timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "report.json").read_text())
    names = [m["method"] for m in report["methods"]]
    assert set(names) == {m.name for m in parse_methods(None)} | {"ddp+powersgd:2", "ddp+localsgd:4"}
    sent = {m["method"]: m["comm_bytes_per_step"] for m in report["methods"]}
    assert sent["ddp+localsgd:4"] == sent["ddp"] // 4 and 0 < sent["ddp+powersgd:2"] < sent["ddp"]
    for m in report["methods"]:
        assert "error" not in m, m
        assert m["samples_per_s"] > 0 and m["test_acc"] is not None
        assert len(m["peak_mem_mib_per_rank"]) == m["processes"]
        assert (m["comm_bytes_per_step"] > 0) == (m["processes"] > 1)
    assert report["environment"]["torch"] and report["environment"]["world_size"] == 2
    md = (out / "report.md").read_text()
    assert all(f"| {n} |" in md for n in names)
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert "| hvd |" in r.stdout  # the table is printed too


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
