"""Issue 32: the flags and commands added since issue 22's pass answer hostile input with one line
(or a named warning, or a fallback), never a traceback or a silent acceptance.

The cases are ``bad_inputs.NEW_FLAG_CASES`` (one list for the benchmark and these tests); the fast
ones run in-process through ``dtrain.cli.main``. Then one test per fixed kind, on the function that
does the check, and a few real runs (marked slow) for what needs training processes.
"""

from __future__ import annotations

import json

import pytest

from tests.logic.cli import test_bad_inputs_new_flags as logic_half
from tests.logic.cli.test_bad_inputs_new_flags import _one_line
from tests.support import run_cli

# The logic half's fixtures, shared: pytest finds a fixture by its name in the module.
fixtures = logic_half.fixtures

# -- real runs ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipeline_result_breakdown_is_null_not_zero(tmp_path):
    proc = run_cli(["train", "--task", "synthetic", "--task-arg", "samples=256", "--batch-size", "16", "--max-steps", "4",
                    "--log-every", "2", "--strategy", "pipeline", "-n", "2"], cwd=str(tmp_path), timeout=200)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank in result["breakdown"]:
        assert rank["median_ms"]["forward"] is None and rank["median_ms"]["backward"] is None
        assert rank["median_ms"]["comm"] is None and rank["median_ms"]["schedule"] > 0
        assert rank["median_ms"]["rest"] < rank["median_ms"]["schedule"] and rank["note"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_local_rank_arg_none_with_a_script_that_requires_it(fixtures):
    proc = run_cli(["run", "-n", "2", "--local-rank-arg", "none", "needs_lr.py"], cwd=str(fixtures), timeout=150)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert "declares --local_rank" in line and "drop --local-rank-arg none" in line
