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

# Issue 55: mistakes that every process of a fault-tolerant job's replica groups met at its start,
# each printing its line, then the launcher its own per group. The launcher refuses them now
# (train/ft_check.py), before any process starts: here in-process, where starting one fails the test.
_FT_SAYS = {
    "train-ft-pp-fewer-blocks": "1 block(s), fewer than the 2 stages", "train-ft-pp-tied": "tie=false",
    "train-ft-pp-microbatches": "a batch of 6 samples", "train-ft-pp-accum-microbatches": "a batch of 2 samples",
    "train-ft-tp-heads": "heads=4", "train-ft-tp-no-plan": "no tensor-parallel plan", "train-ft-task-arg": "classes",
    "train-ft-unknown-optimizer": "'nosuch'", "train-ft-unknown-task": "'nosuch'", "train-ft-no-data": "nosuchdir",
    "train-ft-device-tpu": "'tpu'", "train-ft-float8-cpu": "float8", "train-ft-checkpoint-under-file": "afile",
    "train-ft-ac-no-blocks": "needs the model's blocks",
}
_REFUSED = [c for c in bad_inputs.LATEST_CASES
            if c.argv is not None and c.fast and c.says is None and c.rc == 2 and c.id not in _FT_SAYS]


def test_the_latest_set_has_its_command_line_cases():
    assert len(_REFUSED) >= 30, [c.id for c in _REFUSED]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _REFUSED, ids=[c.id for c in _REFUSED])
def test_latest_flag_bad_input_is_one_line_exit_2(case, fixtures, capsys):
    code = _cli(case.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    _one_line(err)


FT_START_CASES = [(c, _FT_SAYS[c.id]) for c in bad_inputs.LATEST_CASES if c.id in _FT_SAYS]


def test_the_start_mistakes_are_in_the_latest_set():
    assert sorted(c.id for c, _ in FT_START_CASES) == sorted(_FT_SAYS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,says", FT_START_CASES, ids=[c.id for c, _ in FT_START_CASES])
def test_a_fault_tolerant_jobs_start_mistake_is_one_line_before_any_group_starts(case, says, fixtures, capsys):
    code = _cli(case.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in _one_line(err), err
