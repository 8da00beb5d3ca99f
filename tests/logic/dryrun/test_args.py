"""`dtrain dry-run`'s argument checks: each bad value ends with one line and exit status 2 before
any process group forms (in-process through ``dtrain.cli.main``)."""

from __future__ import annotations

import pytest

from dtrain.cli import main as cli_main
from tests.logic.cli.test_bad_inputs import _one_line

BAD = [
    (["--rank", "4", "-n", "4"], "--rank 4 is outside the world of 4"),
    (["--rank", "-1", "-n", "2"], "--rank -1 is outside"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["-n", "0"], "-n must be >= 1, got 0"),
    (["--nnodes", "1:4"], "a dry run checks a fixed world"),
    (["--nnodes", "two"], "--nnodes 'two' is not a number"),
    (["--device-memory", "0"], "--device-memory (GiB)"),
    (["--device-memory", "nan"], "--device-memory (GiB)"),
    (["-n", "4", "--parallel", "dp_shard=3"], "but the job has 4"),
    (["-n", "4", "--parallel", "pp=2,dp_shard=2"], "does not run pipeline stages"),
    (["-n", "4", "--parallel", "auto"], "--parallel auto"),
    (["-n", "2", "--strategy", "pipeline"], "does not run pipeline stages"),
    (["-n", "2", "--strategy", "hvd"], "use ddp"),
    (["-n", "2", "--strategy", "fsdp", "--parallel", "dp_shard=2"], "both say how to split"),
    (["--task-arg", "width"], "is not KEY=VALUE"),
    (["--batch-size", "6", "--grad-accum", "4"], "not divisible by --grad-accum 4"),
    (["-n", "2", "--strategy", "ddp", "--fsdp-wrap", "none"], "--fsdp-wrap applies to --strategy"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_dry_run_argument_is_one_line_exit_2(argv, says, capsys):
    try:
        code = cli_main(["dry-run", "--task", "lm", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in _one_line(err), err
