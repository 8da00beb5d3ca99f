"""The model flags under ``dtrain train --fault-tolerance``: ``--compile``, ``--activation-checkpointing``
and ``--channels-last`` reach each replica group's model, which still takes a peer's state (a heal);
``--comm`` and ``--sync-bn`` are refused with one line, as are the first two where they cannot work,
before any group starts."""

from __future__ import annotations

import pytest
import torch

from dtrain.cli import main as cli_main
from dtrain.context.step import inner_module
from dtrain.ft.spec import FaultTolerance
from dtrain.tasks import load_task
from dtrain.train.config import RuntimeConfig, TaskConfig, TrainConfig
from dtrain.train.ft_replica import _Replica, replica_context
from dtrain.world import World

TASK = "tests.multiprocess.ft.conv_task:make"


def _replica(**runtime) -> _Replica:
    cfg = TrainConfig(task=TaskConfig(name=TASK), runtime=RuntimeConfig(device="cpu", **runtime))
    task = load_task(TASK)
    ctx = replica_context(cfg, task, World.detect(device="cpu"))
    return _Replica(ctx, cfg, FaultTolerance(), task, "a")


def test_compile_checkpointing_and_channels_last_reach_the_groups_model_and_a_heal_still_loads():
    flagged = _replica(compile=True, activation_checkpointing=True, channels_last=True)
    plain = _replica()
    try:
        model = inner_module(flagged.model)
        assert all(b._compiled_call_impl is not None and b._dtrain_checkpointed for b in model.blocks)
        assert model.blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            for p in plain.model.parameters():
                p.add_(1.0)
        # each way round: a group with the flags heals from one without them and back
        flagged.load_state_dict(plain.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(flagged.model.state_dict().values(), plain.model.state_dict().values()))
        assert model.blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)  # loaded in place
        plain.load_state_dict(flagged.state_dict())
    finally:
        flagged.ctx.close()
        plain.ctx.close()


@pytest.mark.parametrize("flags, says", [
    (["--comm", "fp16"], "--comm fp16 (warm-up 10 steps) does not apply under --fault-tolerance"),
    (["--comm-warmup", "3"], "--comm none (warm-up 3 steps) does not apply under --fault-tolerance"),
    (["--sync-bn"], "--sync-bn does not apply under --fault-tolerance"),
    (["--activation-checkpointing", "--task", "digits"], "--activation-checkpointing needs the model's blocks"),
    (["--strategy", "fsdp", "-n", "2", "--channels-last"], "--channels-last does not compose with 'fsdp'"),
])
def test_a_flag_the_groups_cannot_honour_is_one_line_before_any_starts(flags, says, capsys):
    try:
        code = cli_main(["train", "--fault-tolerance", "--max-steps", "2", *flags])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: ") and says in lines[0], err
