"""`dtrain plan` as a user runs it: one JSON object on digits, and one clear line for bad input."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize("args, message", [
    (["--device", "h1000"], "unknown --device 'h1000'"),
    (["--nnodes", "1:3"], "fixed number of nodes"),
    (["--layouts", "dp_shard=3"], "make the product 2"),
    (["--comm-methods", "zip"], "unknown --comm"),
    (["--mfu", "2"], "fraction of the peak"),
    (["--batch-size", "10", "--grad-accum", "3"], "not divisible by --grad-accum 3"),
    (["--links", "/nonexistent/links.json"], "--links '/nonexistent/links.json' cannot be read"),
    (["--profile-seconds", "0"], "--profile-seconds must be > 0"),
])
def test_plan_bad_input_is_one_line_and_status_2(args, message):
    r = run_cli(["plan", "--task", "digits", "-n", "2", *args], timeout=240)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_doctor_links_out_needs_the_probe():
    r = run_cli(["doctor", "--links-out", "links.json", "--no-probe"], timeout=120)
    assert r.returncode == 2 and "--links-out measures in the probe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
