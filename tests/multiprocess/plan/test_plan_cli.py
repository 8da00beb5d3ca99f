"""`dtrain plan` as a user runs it: one JSON object on digits (its bad inputs end before any process
starts: tests/logic/cli/test_plan_bad_inputs.py runs them in-process)."""

from __future__ import annotations

import json

from dtrain.parallel.dims import parse
from tests.support import run_cli


def test_plan_digits_json_has_the_issue_shape_and_a_best_train_accepts():
    r = run_cli(["plan", "--task", "digits", "-n", "2", "--nnodes", "2", "--batch-size", "32", "--json",
                 "--comm-methods", "none,bf16"], timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["world_size"] == 4 and out["layouts"]
    for row in out["layouts"]:
        assert {"layout", "comm", "step_ms", "samples_per_s", "mem_mib_per_rank", "fits"} <= set(row)
        assert row["step_ms"] > 0 and row["samples_per_s"] > 0
    names = {(row["layout"], row["comm"]) for row in out["layouts"]}
    assert {("ddp", "none"), ("ddp", "bf16"), ("zero1", "none"), ("fsdp", "none"), ("hsdp", "none")} <= names
    best = out["best"]
    assert best == out["layouts"][0] and best["fits"]
    # what `dtrain train` takes: a strategy name or a --parallel string
    flag, value = best["train_args"][:2]
    assert flag in ("--strategy", "--parallel")
    if flag == "--parallel":
        assert parse(value).world_size == 4
    assert any("ring all-reduce" in a for a in out["assumptions"])
    assert out["model"]["measured"]["batch"] == 32
    # the layouts' own CPU cost, measured in a world of one, and a worker's memory in the peak per rank
    machinery = out["model"]["machinery"]
    assert {"plain", "ddp:none", "ddp:bf16", "zero1", "fsdp"} <= set(machinery["steps_ms"])
    assert machinery["rss_mib"]["baseline"] > 100
    for row in out["layouts"]:
        assert row["peak_mib_per_rank"] > machinery["rss_mib"]["baseline"] > row["state_mib_per_rank"]


def test_plan_table_names_the_best(tmp_path):
    r = run_cli(["plan", "--task", "digits", "-n", "2", "--comm-methods", "none", "--no-layout-profile"], timeout=240)
    assert r.returncode == 0, r.stderr
    assert "best: " in r.stdout and "dtrain train --strategy" in r.stdout and "assumptions" in r.stdout
