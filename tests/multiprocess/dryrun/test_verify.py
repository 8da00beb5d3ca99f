"""`dtrain plan --verify` as a user runs it (a subprocess): the plan for 8 processes of the lm task,
its pick and each layout given dry-run here (rank 0, the other 7 a fake process group), the
measured peak and state beside the plan's; a layout the dry run finds impossible in one line."""

from __future__ import annotations

import json

import pytest

from tests.support import run_cli

TINY = ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=64", "--task-arg", "heads=2",
        "--task-arg", "context=32", "--task-arg", "max_bytes=100000", "--batch-size", "4"]


@pytest.mark.timeout(300)
def test_plan_verify_puts_rank_0s_dry_run_beside_the_plan_at_world_8():
    args = ["plan", *TINY, "-n", "8", "--layouts", "fsdp;ddp;dp_shard=2,tp=4", "--comm-methods", "none", "--no-layout-profile",
            "--verify"]
    proc = run_cli([*args, "--json"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    got = {v["layout"]: v for v in out["verify"]}
    assert out["verify"][0]["layout"] == out["best"]["layout"] and set(got) == {"fsdp", "ddp", "dp_shard=2,tp=4"}
    fsdp, ddp = got["fsdp"], got["ddp"]
    for v in (fsdp, ddp):
        assert v["measured"]["peak_kind"] == "tensors" and v["measured"]["peak_mib"] > v["measured"]["state_mib"] > 0
        # state is what both count alike (fp32 shards, AdamW's two moments): equal to rounding
        assert v["measured"]["state_mib"] == pytest.approx(v["planned"]["state_mib"], rel=0.02)
    # rank 0 of 8 holds an eighth of fsdp's state (padded rows), all of ddp's
    assert fsdp["measured"]["state_mib"] == pytest.approx(ddp["measured"]["state_mib"] / 8, rel=0.1)
    assert [c["kind"] for c in fsdp["measured"]["collectives"]] == ["all_gather", "reduce_scatter"]
    assert got["dp_shard=2,tp=4"]["impossible"].startswith("task 'lm': heads=2 cannot be split over tp=4")
    text = run_cli(args, timeout=240)
    assert text.returncode == 0, text.stderr
    lines = [ln for ln in text.stdout.splitlines() if ln.startswith("verify ")]
    assert len(lines) == 3 and any("cannot run: task 'lm': heads=2" in ln for ln in lines)
    assert any(ln.startswith("verify fsdp (rank 0 of 8, dry run): peak ") for ln in lines)
