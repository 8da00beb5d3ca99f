"""The flags of issues 53-56 (``bad_inputs.LATEST_CASES``: plan float8, --micro-batch auto, --batch-split,
--parallel auto on several nodes, --fault-tolerance, hf:PATH, --launcher ray): the fast command-line
cases, in-process through ``dtrain.cli.main``, each refused with one line and exit status 2. The
benchmark (``benchmarks/bad_inputs.py --set latest``) runs them all, the slow ones included, as
subprocesses."""

from __future__ import annotations

import pytest

from tests.logic.cli import test_bad_inputs as base
from tests.logic.cli.test_bad_inputs_new_flags import _cli

bad_inputs, _one_line = base.bad_inputs, base._one_line
fixtures = base.fixtures

_REFUSED = [c for c in bad_inputs.LATEST_CASES if c.argv is not None and c.fast and c.says is None and c.rc == 2]


def test_the_latest_set_has_its_command_line_cases():
    assert len(_REFUSED) >= 30, [c.id for c in _REFUSED]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _REFUSED, ids=[c.id for c in _REFUSED])
def test_latest_flag_bad_input_is_one_line_exit_2(case, fixtures, capsys):
    code = _cli(case.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    _one_line(err)


# Issue 55: mistakes that every process of a fault-tolerant job's replica groups met at its start,
# each printing its line, then the launcher its own per group. The launcher refuses them now
# (train/ft_check.py), before any process starts: here in-process, where starting one fails the test.
_FT = ["train", "--fault-tolerance", "--max-steps", "2"]
_LM2 = ["--task", "lm", "--task-arg", "tie=false", "-n", "2"]
FT_START_CASES = [
    (bad_inputs.Case("train-ft-pp-fewer-blocks", [*_FT, "--task", "lm", "--task-arg", "layers=1", "-n", "2", "--parallel",
                                                  "pp=2"]), "1 block(s), fewer than the 2 stages"),
    (bad_inputs.Case("train-ft-pp-tied", [*_FT, "--task", "lm", "-n", "2", "--parallel", "pp=2"]), "tie=false"),
    (bad_inputs.Case("train-ft-pp-microbatches", [*_FT, *_LM2, "--parallel", "pp=2", "--batch-size", "6"]),
     "a batch of 6 samples"),
    (bad_inputs.Case("train-ft-pp-accum-microbatches", [*_FT, *_LM2, "--parallel", "pp=2", "--grad-accum", "8"]),
     "a batch of 2 samples"),
    (bad_inputs.Case("train-ft-tp-heads", [*_FT, "--task", "lm", "--task-arg", "heads=4", "-n", "3", "--parallel", "tp=3"]),
     "heads=4"),
    (bad_inputs.Case("train-ft-tp-no-plan", [*_FT, "--task", "digits", "-n", "2", "--parallel", "tp=2"]),
     "no tensor-parallel plan"),
    (bad_inputs.Case("train-ft-task-arg", [*_FT, "--task", "synthetic", "--task-arg", "classes=0", "-n", "2"]), "classes"),
    (bad_inputs.Case("train-ft-unknown-optimizer", [*_FT, "--task", "synthetic", "--optimizer", "nosuch", "-n", "2"]),
     "'nosuch'"),
    (bad_inputs.Case("train-ft-unknown-task", [*_FT, "--task", "nosuch", "-n", "2"]), "'nosuch'"),
    (bad_inputs.Case("train-ft-no-data", [*_FT, "--task", "mnist", "--data-dir", "nosuchdir", "-n", "2"]), "nosuchdir"),
    (bad_inputs.Case("train-ft-device-tpu", [*_FT, "--device", "tpu", "-n", "2"]), "'tpu'"),
    (bad_inputs.Case("train-ft-float8-cpu", [*_FT, "--device", "cpu", "--precision", "float8", "-n", "2"]), "float8"),
    (bad_inputs.Case("train-ft-checkpoint-under-file", [*_FT, "--checkpoint-dir", "afile/ck", "-n", "2"]), "afile"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,says", FT_START_CASES, ids=[c.id for c, _ in FT_START_CASES])
def test_a_fault_tolerant_jobs_start_mistake_is_one_line_before_any_group_starts(case, says, fixtures, capsys):
    code = _cli(case.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in _one_line(err), err
