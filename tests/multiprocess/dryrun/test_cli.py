"""`dtrain dry-run` as a user meets it (a subprocess): a large world on this CPU, and the
configurations that cannot run, each ending with one line naming the cause."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dtrain.tasks.gpt import gpt
from tests.logic.cli.test_bad_inputs import _one_line
from tests.support import run_cli

TINY = ["--task", "lm", "--task-arg", "layers=1", "--task-arg", "width=32", "--task-arg", "heads=2",
        "--task-arg", "context=16", "--task-arg", "max_bytes=100000", "--batch-size", "2", "--steps", "1", "--device", "cpu"]


@pytest.mark.timeout(300)
def test_world_512_runs_rank_0_with_its_shard_only():
    small = run_cli(["dry-run", "--json", *TINY, "-n", "2", "--strategy", "fsdp"], timeout=240)
    big = run_cli(["dry-run", "--json", *TINY, "-n", "8", "--nnodes", "64", "--strategy", "fsdp"], timeout=240)
    assert small.returncode == 0 and big.returncode == 0, small.stderr + big.stderr
    two, many = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (small, big))
    assert many["world_size"] == 512 and many["dims"]["dp_shard"] == 512
    # FSDP2 shards each parameter's rows (padded): over 2 ranks rank 0 holds ceil(rows/2) of each,
    # over 512 one row of each (none of them has more than 512 rows).
    with torch.device("meta"):
        model = gpt(vocab=256, context=16, layers=1, heads=2, width=32)
    rows = [(p.shape[0], p.numel() // p.shape[0]) for p in model.parameters()]
    assert two["params_local"] == sum(math.ceil(n / 2) * size for n, size in rows)
    assert many["params_local"] == sum(size for _, size in rows)
    assert [c["kind"] for c in many["collectives"]] == ["all_gather", "reduce_scatter"]
    assert many["predicted"]["state_mib"] is not None


@pytest.mark.timeout(300)
def test_heads_not_divisible_by_tp_is_one_line_exit_2():
    proc = run_cli(["dry-run", *TINY, "-n", "4", "--parallel", "tp=4", "--task-arg", "heads=6", "--task-arg", "width=48"],
                   timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "heads=6 cannot be split over tp=4" in _one_line(proc.stderr)


@pytest.mark.timeout(300)
def test_a_rank_with_no_element_of_any_parameter_is_one_line_exit_2():
    # Every parameter of this model has fewer rows (at most 256: the byte vocabulary) than the
    # 512 ranks that shard it: rank 300 would hold nothing.
    proc = run_cli(["dry-run", *TINY, "-n", "512", "--strategy", "fsdp", "--rank", "300"], timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "rank 300 of 512 holds no element of any parameter" in _one_line(proc.stderr)


@pytest.mark.timeout(300)
def test_a_peak_above_the_device_memory_does_not_fit_exit_1():
    proc = run_cli(["dry-run", "--json", *TINY, "-n", "2", "--strategy", "fsdp", "--device-memory", "0.000001"], timeout=240)
    assert proc.returncode == 1, proc.stderr
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["fits"] is False and rec["peak_mib"] > rec["device_memory_mib"]
    text = run_cli(["dry-run", *TINY, "-n", "2", "--strategy", "fsdp", "--device-memory", "0.000001", "--no-predict"], timeout=240)
    assert text.returncode == 1 and "does NOT fit" in text.stdout
