"""`dtrain train --parallel auto` on 2 processes: the plan profiles the task, names its pick, and
the job trains with it."""

from __future__ import annotations

import json

import pytest

from dtrain.parallel.dims import resolve
from dtrain.strategies.composed import label
from tests.support import run_cli


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parallel_auto_trains_with_the_plans_pick():
    r = run_cli(["train", "--task", "digits", "-n", "2", "--parallel", "auto", "--max-steps", "4", "--log-every", "2"], timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("dtrain: --parallel auto: the plan picked "))
    picked = line.removeprefix("dtrain: --parallel auto: the plan picked ").split(" (")[0]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == 4
    # A strategy name trains under that name; a --parallel layout under its way's name (dp_shard=2: fsdp; a mix: composed).
    expected = label(resolve(picked)) if "=" in picked else picked
    assert result["strategy"] == expected, (picked, result["strategy"])
