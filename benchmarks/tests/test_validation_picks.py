"""The bed validation's pick tally (benchmarks/plan_validation_table.py, `plan_validation.py
--picks`): each group of each run one pick, right, unsettled (missed, the pick's runs overlapping
the fastest's) or missed; clear and close calls by the plan's margin."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Benchmark tooling, tested with the benchmarks (python3 -m pytest benchmarks/tests), not in the product's suite.
_spec = importlib.util.spec_from_file_location("plan_validation_table", Path(__file__).resolve().parents[1] / "plan_validation_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def _row(group: str, comm: str, pred_sps: float, runs_ms: list[float]) -> dict:
    runs = sorted(runs_ms)
    median = runs[len(runs) // 2]
    return {"group": group, "layout": "ddp", "comm": comm, "pred_samples_per_s": pred_sps, "measured_ms": median,
            "measured_runs_ms": runs_ms, "meas_samples_per_s": 1000.0 / median}


def test_picks_of_several_runs_are_right_unsettled_or_missed(capsys):
    runs = {
        # the plan's pick (none) is the fastest measured; bf16 predicted 20% behind: a clear call, right
        "run1": [_row("a", "none", 120.0, [10.0, 11.0, 12.0]), _row("a", "bf16", 100.0, [14.0, 15.0, 16.0])],
        # the pick (bf16, 5% ahead: a close call) measured slower, but its fastest run (10) beats the
        # fastest's slowest (11): unsettled
        "run2": [_row("a", "none", 100.0, [9.0, 10.0, 11.0]), _row("a", "bf16", 105.0, [10.0, 12.0, 13.0])],
        # the pick (bf16, clear) measured slower in every run: missed; its regret 20 / 16 - 1 = 25%
        "run3": [_row("a", "none", 80.0, [15.0, 16.0, 16.5]), _row("a", "bf16", 100.0, [19.0, 20.0, 21.0])],
    }
    table.pick_tally(runs, margin=0.10)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run1 a: right;") and "[close call]" not in out[0]
    assert out[1].startswith("run2 a: unsettled;") and out[1].endswith("[close call]")
    assert out[2].startswith("run3 a: missed;") and "25.0% faster" in out[2] and "runs 15/16/16 against 19/20/21 ms" in out[2]
    assert "3 picks over 3 runs: right 1 (33%); missed 2, of them 1 unsettled" in out[4]
    assert "right or unsettled 2 (67%)" in out[4]
    assert out[5] == "clear calls (runner-up predicted 10% or more behind): 1 of 2 right; close calls: 0 of 1 right"
    # regrets: 0, 12/10 - 1 = 20%, 25%
    assert out[6] == "the pick measured a median 20.0%, mean 15.0%, at most 25.0% slower than the fastest"
