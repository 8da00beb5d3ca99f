"""Every bad input ends with one line ``dtrain: error: ...`` and exit status 2 (issue 22, point 6).

The cases come from ``benchmarks/bad_inputs.py`` (one list for the measurement and the tests).
Fast CLI cases run in-process through ``dtrain.cli.main``; API snippets run in-process; a
representative few run as real subprocesses through ``run_cli``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtrain
from tests.logic.cli import test_bad_inputs as logic_half
from tests.logic.cli.test_bad_inputs import _API, _one_line, bad_inputs
from tests.support import run_cli

# The logic half's fixtures, shared: pytest finds a fixture by its name in the module.
fixtures = logic_half.fixtures

# Start-to-end through a real process: the cases that were tracebacks or noise.
_SUBPROCESS = ["train-synthetic-classes-0", "train-device-tpu", "train-metrics-file-under-file", "submit-k8s-yaml-job",
               "doctor-timeout-negative", "run-master-addr-not-a-host"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case_id", _SUBPROCESS)
def test_subprocess_bad_input_is_one_line_exit_2(case_id, fixtures):
    case = next(c for c in bad_inputs.CASES if c.id == case_id)
    proc = run_cli(list(case.argv), cwd=str(fixtures), timeout=60)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr)
    assert "Traceback" not in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(fixtures):
    proc = run_cli([*bad_inputs.S, "--lr", "1e30", "--log-every", "2", "--checkpoint-dir", "ck", "--save-every", "1"],
                   cwd=str(fixtures), timeout=150)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert "at step 2" in line and "lower --lr" in line
    saved = sorted(p.name for p in (fixtures / "ck").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-00000001"], saved  # step 1's loss was finite; nothing saved after the NaN


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _API, ids=[c.id for c in _API])
def test_api_bad_input_raises_one_line_dtrain_error(case, fixtures):
    import dtrain.compat.horovod as hvd

    try:
        with pytest.raises(dtrain.DtrainError) as info:
            exec(compile(case.py, f"<{case.id}>", "exec"), {"dtrain": dtrain, "torch": torch, "nn": nn})
    finally:
        hvd.shutdown()
    message = str(info.value)
    assert message and "\n" not in message
    assert ";" in message or "must" in message, f"no fix or rule in: {message}"
