"""``--compile --activation-checkpointing --channels-last`` under ``--fault-tolerance``: 2 replica
groups (min=2) train the conv task, the second heals from the first at step 0 into its compiled,
checkpointed, channels-last model, and both end with the same state, in channels-last layout and
with the plain parameter names. ``--async-save`` and ``--tensorboard`` reach each group."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import run_cli

from .test_fault_tolerance import _model_state

pytest.importorskip("torchft")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_compiled_checkpointed_channels_last_groups_heal_and_stay_equal(tmp_path):
    r = run_cli(["train", "--fault-tolerance", "min=2,heartbeat=1", "--nproc", "2", "--task", "tests.multiprocess.ft.conv_task:make",
                 "--compile", "--activation-checkpointing", "--channels-last", "--max-steps", "3",
                 "--checkpoint-dir", str(tmp_path / "ckpt")], timeout=450)
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["steps"] for x in results] == [3, 3], r.stdout
    assert sorted(len(x["fault_tolerance"]["healed_at_steps"]) for x in results) == [0, 1]  # one healed from the other
    (_, a), (_, b) = (_model_state(str(tmp_path / "ckpt" / f"replica-0-{i}")) for i in (0, 1))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert "blocks.0.0.weight" in a and a["blocks.0.0.weight"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.timeout(300)
def test_async_saves_and_tensorboard_runs_of_two_groups(tmp_path):
    """``--async-save`` and ``--tensorboard`` through the launcher: each group's checkpoints (written in
    the background, every step) are complete and equal, and each group has its own TensorBoard run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    r = run_cli(["train", "--fault-tolerance", "min=2,heartbeat=1", "--nproc", "2", "--task", "tests.multiprocess.ft.conv_task:make",
                 "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "1", "--async-save",
                 "--tensorboard", str(tb), "--log-every", "1"], timeout=270)
    assert r.returncode == 0, r.stderr
    (pa, a), (pb, b) = (_model_state(str(tmp_path / "ckpt" / f"replica-0-{i}")) for i in (0, 1))
    assert pa.endswith("step-00000003") and pb.endswith("step-00000003")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    for i in (0, 1):
        events = EventAccumulator(str(tb / f"replica-0-{i}"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
