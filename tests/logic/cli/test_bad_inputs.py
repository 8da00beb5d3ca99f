"""Every bad input ends with one line ``dtrain: error: ...`` and exit status 2 (issue 22, point 6).

The cases come from ``benchmarks/bad_inputs.py`` (one list for the measurement and the tests).
Fast CLI cases run in-process through ``dtrain.cli.main``; API snippets run in-process; a
representative few run as real subprocesses through ``run_cli``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from dtrain.cli import main as cli_main
from tests.paths import ROOT

_PATH = ROOT / "benchmarks" / "bad_inputs.py"
_spec = importlib.util.spec_from_file_location("bad_inputs", _PATH)
bad_inputs = importlib.util.module_from_spec(_spec)
sys.modules["bad_inputs"] = bad_inputs
_spec.loader.exec_module(bad_inputs)

# Cases this branch does not fix (other parts of issue 22), and ones that start real work.
_ELSEWHERE = {c.id for c in bad_inputs.CASES if c.owner}
_CLI = [c for c in bad_inputs.CASES if c.argv is not None and c.module == "dtrain" and c.fast and c.id not in _ELSEWHERE]
_API = [c for c in bad_inputs.CASES if c.py is not None and c.id not in _ELSEWHERE]
_NETBED = [c for c in bad_inputs.CASES if c.module == "tests.support.netbed"]


@pytest.fixture
def fixtures(tmp_path, monkeypatch):
    bad_inputs.make_fixtures(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(env)  # the CLI hands flags to workers through the environment
    assert not (tmp_path / "PWNED").exists()


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    assert "Traceback" not in err and "frame #" not in err, err
    assert lines[-1].startswith("dtrain: error:"), err
    assert sum(ln.startswith("dtrain: error:") for ln in lines) == 1, err
    return lines[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _CLI, ids=[c.id for c in _CLI])
def test_cli_bad_input_is_one_line_exit_2(case, fixtures, capsys):
    try:
        code = cli_main(list(case.argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    _one_line(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _NETBED, ids=[c.id for c in _NETBED])
def test_netbed_bad_input_is_one_line_exit_2(case, fixtures, capsys):
    from tests.support.netbed import main

    with pytest.raises(SystemExit) as info:
        main(list(case.argv))
    assert info.value.code == 2
    _one_line(capsys.readouterr().err)




def test_submit_out_in_a_missing_folder_is_created(fixtures, capsys):
    code = cli_main(["submit", "--k8s", "--out", "newdir/sub/job.yaml", "--name", "t", "--image", "me/train:1",
                     "--", "dtrain", "train"])
    assert code == 0, capsys.readouterr().err
    assert "PyTorchJob" in (fixtures / "newdir" / "sub" / "job.yaml").read_text()


def test_bench_classifier():
    assert bad_inputs.classify(2, "", "x\ndtrain: error: bad; fix.\n")[0] == "clear"
    assert bad_inputs.classify(1, "", "dtrain: error: bad; fix.\n")[0] == "other"
    assert bad_inputs.classify(2, "", "Traceback (most recent call last):\ndtrain: error: x\n")[0] == "traceback"
    assert bad_inputs.classify(None, "", "")[0] == "hang"
    assert bad_inputs.classify(2, "", "dtrain: error: a\ndtrain: error: a\n")[0] == "other"
    assert bad_inputs.classify(0, "ok", "")[0] == "silent"  # accepted where a refusal was due (issue 32)
