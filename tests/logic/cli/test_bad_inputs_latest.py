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
