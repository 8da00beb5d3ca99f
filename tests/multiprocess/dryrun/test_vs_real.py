"""A dry run (`dtrain dry-run`: rank 0 alone, torch's fake process group, the model built on
the meta device) against a real 2-process gloo run of the same program (the model built whole,
as `dtrain train` does), measured by the same tracker: rank 0's peak within 5%, the same state,
and the same collectives per step (kind, mesh dimension, count, bytes)."""

from __future__ import annotations

import json

import pytest

from tests.support import run_cli, run_distributed

SMALL = ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=64", "--task-arg", "max_bytes=200000",
         "--batch-size", "8", "--steps", "2", "--device", "cpu", "--no-predict", "-n", "2"]


def _real_rank(args: list[str]) -> dict:
    """Rank of the real run: dtrain dry-run's own flags, on the gloo group this process joins."""
    from dtrain.cli import build_parser
    from dtrain.cli.dryrun import config_from_args
    from dtrain.dryrun import run_rank
    from dtrain.dryrun.track import summarise
    from dtrain.world import World

    cfg = config_from_args(build_parser().parse_args(["dry-run", *args]))
    run = run_rank(cfg, World.detect(device="cpu"), materialize="eager")
    return {"peak_mib": run.peak_bytes / 2**20, "state_mib": sum(run.state.values()) / 2**20,
            "collectives": summarise(run.steps[-1])}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [["--strategy", "fsdp"], ["--strategy", "ddp"], ["--parallel", "tp=2"]],
                         ids=["fsdp", "ddp", "tp"])
def test_dry_run_matches_rank_0_of_a_real_two_process_run(layout):
    flags = [*SMALL, *layout]
    proc = run_cli(["dry-run", "--json", *flags], timeout=300)
    assert proc.returncode == 0, proc.stderr
    dry = json.loads(proc.stdout.strip().splitlines()[-1])
    real = run_distributed(_real_rank, flags, world_size=2, timeout=300)[0]
    assert dry["collectives"] == real["collectives"]
    assert dry["collectives"], "no collective seen"
    assert dry["state_mib"] == pytest.approx(real["state_mib"], abs=0.006)  # the record rounds to 0.01 MiB
    assert dry["peak_mib"] == pytest.approx(real["peak_mib"], rel=0.05)
