"""Issue 32: the flags and commands added since issue 22's pass answer hostile input with one line
(or a named warning, or a fallback), never a traceback or a silent acceptance.

The cases are ``bad_inputs.NEW_FLAG_CASES`` (one list for the benchmark and these tests); the fast
ones run in-process through ``dtrain.cli.main``. Then one test per fixed kind, on the function that
does the check, and a few real runs (marked slow) for what needs training processes.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest
import torch

from dtrain.cli import main as cli_main
from dtrain.errors import CheckpointError, ConfigError
from tests.logic.cli import test_bad_inputs as base

# The helpers of issue 22's tests: the case list, the fixture folder, the one-line check, and the
# dtrain logger given back after each test (autouse).
bad_inputs, _one_line = base.bad_inputs, base._one_line
fixtures = base.fixtures

_NEW = bad_inputs.NEW_FLAG_CASES
_REFUSED = [c for c in _NEW if c.argv is not None and c.fast and c.says is None]
_ANSWERED = [c for c in _NEW if c.argv is not None and c.fast and c.says is not None]
_API = [c for c in _NEW if c.py is not None and c.fast]


def _cli(argv: list[str]) -> int:
    try:
        return cli_main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        return exc.code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _REFUSED, ids=[c.id for c in _REFUSED])
def test_new_flag_bad_input_is_one_line_exit_2(case, fixtures, capsys):
    code = _cli(case.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    _one_line(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _ANSWERED, ids=[c.id for c in _ANSWERED])
def test_new_flag_input_gets_its_verdict_or_warning(case, fixtures, capsys):
    code = _cli(case.argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert code == case.rc, out
    assert case.says in out.out + out.err, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _API, ids=[c.id for c in _API])
def test_new_api_bad_input_raises_one_line(case, fixtures):
    from torch import nn

    import dtrain

    with pytest.raises(dtrain.DtrainError) as info:
        exec(compile(case.py, f"<{case.id}>", "exec"), {"dtrain": dtrain, "torch": torch, "nn": nn})
    assert str(info.value) and "\n" not in str(info.value)


def test_every_fast_case_is_tried_here():
    assert len(_REFUSED) + len(_ANSWERED) + len(_API) + sum(not c.fast for c in _NEW) == len(_NEW)
    assert len(_NEW) >= 95  # the issue tried 95 inputs; the benchmark holds at least as many


# -- output paths: tried by creating a file, at start ----------------------------------------------

def test_output_paths_under_proc_fail_at_start_with_the_flag_named():
    from dtrain import _check as check
    from dtrain.checkpoint import lock

    if not os.path.isdir("/proc/self") or check.write_probe("/proc") is None:
        pytest.skip("needs a /proc where no file can be created")
    for flag in ("--ledger", "--tensorboard", "--out"):
        with pytest.raises(ConfigError, match=f"^{flag} /proc/x: folder /proc is not writable"):
            check.output_dir(flag, "/proc/x")
    with pytest.raises(ConfigError, match="^--trace-file /proc/t.json: folder /proc is not writable"):
        check.output_file("--trace-file", "/proc/t.json")
    # The --checkpoint-dir check is the same function (make_dir), as it was: one line.
    with pytest.raises(CheckpointError, match="choose a writable --checkpoint-dir"):
        lock.preflight("/proc/dtrain-ck")


def test_write_probe_leaves_nothing_behind(tmp_path):
    from dtrain import _check as check

    assert check.write_probe(str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
    check.make_dir("ledger folder", str(tmp_path / "a" / "b"), "--ledger")
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


def test_train_config_checks_tensorboard_and_ledger_before_training(tmp_path):
    from dtrain.train.config import ObserveConfig

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        ObserveConfig(ledger=str(tmp_path / "f" / "ledger"))
    with pytest.raises(ConfigError, match="--tensorboard"):
        ObserveConfig(tensorboard=str(tmp_path / "f" / "tb"))


# -- values that switch a feature off ----------------------------------------------------------

@pytest.mark.parametrize("threshold", [float("inf"), float("nan"), 1.0, 0.5])
def test_straggler_threshold_that_names_no_rank_is_refused(threshold):
    from dtrain.metrics.stragglers import StragglerConfig

    with pytest.raises(ConfigError, match="--straggler-threshold must be > 1"):
        StragglerConfig(threshold=threshold)


def test_trace_range_against_the_run(caplog):
    from dtrain.train.observe import trace_fits

    with pytest.raises(ConfigError, match=r"--trace 5:7: the run has 3 steps"):
        trace_fits((5, 7), 0, 3, is_main=True)
    with caplog.at_level("WARNING", logger="dtrain"):
        assert trace_fits((2, 100), 0, 3, is_main=True)
        assert not trace_fits((2, 4), 10, 20, is_main=True)  # resumed past it: nothing traced, said so
    text = caplog.text
    assert "the trace holds steps 2 to 3" in text and "resumed at step 10" in text
    assert trace_fits((2, 4), 0, 20, is_main=True)


def test_nan_rendezvous_times_are_refused(fixtures, capsys):
    assert _cli([*bad_inputs.E, "--rdzv-last-call", "nan"]) == 2
    assert "--rdzv-last-call must be a finite number, got nan" in _one_line(capsys.readouterr().err)


# -- --parallel -----------------------------------------------------------------------------------

def test_parallel_names_the_repeated_key():
    from dtrain.parallel import parse

    with pytest.raises(ConfigError, match=r"names tp twice \(tp=2 and tp=1\); give each name once"):
        parse("tp=2,tp=1")


# -- --local-rank-arg -----------------------------------------------------------------------------

def test_local_rank_arg_value_must_be_an_option_name():
    import argparse

    from dtrain.cli.run import _flag_spelling

    assert _flag_spelling("--local-rank") == "--local-rank" and _flag_spelling("none") == "none"
    for swallowed in ("train.py", "local_rank", "-l"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not an option name.*with '='"):
            _flag_spelling(swallowed)


def test_local_rank_arg_before_the_script_says_the_rule(fixtures, capsys):
    assert _cli(["run", "-n", "2", "--local-rank-arg", "plain.py", "-a", "x"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "'plain.py' is not an option name" in line and "--local-rank-arg=--local_rank" in line


# -- checkpoints judged as loading judges them -------------------------------------------------

def test_verify_refuses_a_state_that_pickles_a_function_and_resume_falls_back(fixtures):
    from dtrain.checkpoint import newest_valid, resolve, verify

    bad = verify("funcck/step-00000002")
    assert not bad.ok and "weights_only" in bad.problem
    assert verify("funcck/step-00000001").ok
    assert not verify("func.pt").ok and verify("func.pt", load=False).ok
    assert newest_valid("funcck")[0] == "funcck/step-00000001"  # what --resume, diff and consolidate use
    assert resolve("funcck") == "funcck/step-00000001"


def test_verify_refuses_a_state_that_is_no_training_state(tmp_path):
    from dtrain.checkpoint import verify
    from dtrain.checkpoint.store import write_checkpoint

    path = write_checkpoint(str(tmp_path), 3, {"state.pt": {"weights": torch.ones(2)}}, {"world_size": 1})
    v = verify(path)
    assert not v.ok and "no 'objects' mapping" in v.problem


# -- dtrain ckpt ledger -------------------------------------------------------------------------

def _ledger(tmp_path, text: str | bytes):
    name = tmp_path / "gen00001-rank00000.jsonl"
    if isinstance(text, bytes):
        name.write_bytes(text)
    else:
        name.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("text", [bytes(range(256)) * 4, bad_inputs.LEDGERS["ledger_types"], bad_inputs.LEDGERS["ledger_header"],
                                  bad_inputs.LEDGERS["ledger_strings"], bad_inputs.LEDGERS["ledger_range"]],
                         ids=["binary", "types", "header", "strings", "range"])
def test_ledger_without_a_valid_step_record_is_an_error(tmp_path, text):
    from dtrain.data.ledger import check_ledger

    with pytest.raises(ConfigError, match="no valid step record"):
        check_ledger(_ledger(tmp_path, text))


def test_ledger_leaves_out_and_counts_malformed_lines(tmp_path):
    from dtrain.data.ledger import check_ledger

    text = '{"begin": 0, "n": 4}\n{"s": 1, "e": 0, "i": [0, 1]}\n{"s": 2, "e": 0, "i": 7}\n{"s": 2, "e": 0, "i": [2, 3], "d": []}\n'
    report = check_ledger(_ledger(tmp_path, text))
    assert report.torn_lines == 1 and report.steps_kept == 2 and report.ok
    assert report.epochs[0].seen == 4 and report.epochs[0].missing == 0


def test_ledger_header_claiming_200_million_samples_allocates_nothing(tmp_path):
    from dtrain.data.ledger import check_ledger

    path = _ledger(tmp_path, bad_inputs.LEDGERS["ledger_huge"])
    tracemalloc.start()
    try:
        report = check_ledger(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.epochs[0].missing == 200_000_000 - 2 and report.epochs[0].examples == [2, 3, 4, 5, 6]
    assert peak < 10 * 2**20, peak  # range(200M) as a set would be ~10 GiB


# -- dtrain report ------------------------------------------------------------------------------

def test_report_leaves_out_wrong_types_and_says_so(fixtures, caplog):
    from dtrain.metrics.report import load_run

    with caplog.at_level("WARNING", logger="dtrain"):
        records, result = load_run("run_fields")
    assert records == [{"step": 1}] and result == {}
    assert "7 field(s) of the wrong type" in caplog.text  # 5 in metrics.jsonl, 2 in result.json
    with pytest.raises(ConfigError, match=r"no metrics records .* \(2 line\(s\) that are not one\)"):
        load_run("run_strings")
    with pytest.raises(ConfigError, match="no metrics records"):
        load_run("run_binary")


def test_report_breakdown_takes_null_phases_and_ragged_ranks():
    from dtrain.metrics.report import rank_breakdown

    records = [{"step": 1, "breakdown": [{"median_ms": {"forward": None, "rest": 2.0}}, {"median_ms": {"forward": None, "rest": 4.0}}]},
               {"step": 2, "breakdown": [{"median_ms": {"forward": None, "rest": 3.0}}]}]
    assert rank_breakdown(records, None) == [{"rest": 2.5}, {"rest": 4.0}]


# -- pipeline's breakdown: null, never 0 ----------------------------------------------------------

def test_staged_steps_report_forward_backward_comm_as_null():
    from dtrain.metrics.breakdown import SCHEDULE, pack, stats, unpack

    # data_wait, forward, backward, comm, optimizer, rest, schedule
    w = stats([(1.0, 0.0, 0.0, 0.0, 2.0, 0.5, 20.0), (1.0, 0.0, 0.0, 0.0, 2.0, 0.5, 22.0)])
    assert w["median_ms"]["forward"] is None and w["median_ms"]["comm"] is None and w["median_ms"]["own"] is None
    assert w["median_ms"][SCHEDULE] == 21.0 and w["median_ms"]["step"] == 24.5 and "pipeline" in w["note"]
    assert unpack(pack(w)) == w
    plain = stats([(1.0, 2.0, 3.0, 0.0, 1.0, 0.5)])
    assert SCHEDULE not in plain["median_ms"] and "note" not in plain and unpack(pack(plain)) == plain


def test_stragglers_are_not_judged_on_staged_windows():
    from dtrain.metrics.breakdown import stats
    from dtrain.metrics.stragglers import StragglerConfig, StragglerDetector

    det = StragglerDetector(StragglerConfig(window=1), ["a", "b"])
    fast, slow = stats([(0, 0, 0, 0, 1, 1, 10)]), stats([(0, 0, 0, 0, 1, 1, 50)])
    assert det.add(1, [fast, slow]) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_falls_back_past_a_state_that_pickles_a_function(fixtures, capsys):
    from torch import nn

    import dtrain

    with pytest.raises(SystemExit) as info:
        exec(compile(bad_inputs.RESUME_PAST_FUNCTION, "<resume>", "exec"), {"dtrain": dtrain, "torch": torch, "nn": nn})
    err = capsys.readouterr().err
    assert info.value.code == 0, err
    assert "skipping checkpoint ck/step-00000002" in err and "resumed from ck/step-00000001 at step 1" in err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trace_ending_inside_the_range_is_named(fixtures, capsys):
    assert _cli([*bad_inputs.T, "--trace", "2:100"]) == 0
    err = capsys.readouterr().err
    assert "the trace holds steps 2 to 3" in err and "trace of steps 2 to 3" in err
