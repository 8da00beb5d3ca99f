"""The other flags under ``--fault-tolerance``: ``--async-save`` and ``--tensorboard`` reach each replica
group (its checkpoints are written in the background; its records go to ``DIR/replica-ID``); the flags
its loop or its launcher have no part for, in ``dtrain train`` and in ``dtrain run``, are one line and
exit status 2 before any group starts, not ignored."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from dtrain.checkpoint import newest_valid
from dtrain.cli import build_parser
from dtrain.cli import main as cli_main
from dtrain.cli.train import config_from_args
from dtrain.cli.train_ft import _refuse_launch_flags
from dtrain.ft.spec import FaultTolerance
from dtrain.tasks import load_task
from dtrain.train.config import CheckpointConfig, ObserveConfig, RuntimeConfig, TaskConfig, TrainConfig
from dtrain.train.ft_check import refuse_unsupported
from dtrain.train.ft_replica import _Replica, replica_context
from dtrain.world import World
from tests.paths import ROOT

TASK = "tests.multiprocess.ft.conv_task:make"
SCRIPT = str(ROOT / "examples" / "fault_tolerant.py")


class _Manager:
    """What ``_Replica.save`` and ``_committed`` ask of torchft's Manager."""

    def __init__(self, step: int) -> None:
        self.step = step

    def current_step(self) -> int:
        return self.step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.step}


def _replica(**sections) -> _Replica:
    cfg = TrainConfig(task=TaskConfig(name=TASK), runtime=RuntimeConfig(device="cpu"), **sections)
    task = load_task(TASK)
    replica = _Replica(replica_context(cfg, task, World.detect(device="cpu")), cfg, FaultTolerance(), task, "a")
    replica.manager = _Manager(20)
    return replica


def test_async_save_writes_the_groups_checkpoint_in_the_background(tmp_path):
    replica = _replica(checkpoint=CheckpointConfig(dir=str(tmp_path), async_save=True))
    try:
        assert replica.ckpt.async_save
        replica.save(20)
        assert replica.ckpt._thread is not None  # the write runs after save returned
        replica.ckpt.wait()
        path, _ = newest_valid(str(tmp_path / "replica-a"))
        assert path is not None and path.endswith("step-00000020")
        state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
        assert state["extra"]["torchft"]["step"] == 20
        model = replica.model.state_dict()
        assert all(torch.equal(v, model[k]) for k, v in state["objects"]["model"].items())
    finally:
        replica.ctx.close()


def test_tensorboard_gets_each_groups_records_in_its_own_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = tmp_path / "m.jsonl"
    replica = _replica(observe=ObserveConfig(tensorboard=str(tmp_path / "tb"), metrics_file=str(metrics), log_every=10))
    try:
        replica.sinks = replica._sinks()
        replica._joined_at = None
        replica._committed(SimpleNamespace(epoch=0), 2, torch.tensor(0.25), None, 0.0)
    finally:
        for sink in replica.sinks:
            sink.close()
        replica.ctx.close()
    events = EventAccumulator(str(tmp_path / "tb" / "replica-a"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(20, 0.25)]
    record = json.loads(metrics.read_text())
    assert record["step"] == 20 and record["replica"] == "a" and record["participants"] == 2


def _refused(argv: list[str], capsys) -> str:
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: "), err
    return lines[0]


@pytest.mark.parametrize("flags, says", [
    (["--num-workers", "2"], "--num-workers 2 does not apply under --fault-tolerance"),
    (["--batch-split", "speed"], "--batch-split speed does not apply under --fault-tolerance"),
    (["--batch-split", "40,24"], "--batch-split 40,24 does not apply under --fault-tolerance"),
    (["--trace", "2:4"], "--trace 2:4 does not apply under --fault-tolerance"),
    (["--warmup-steps", "3"], "--warmup-steps 3 does not apply under --fault-tolerance"),
    (["--straggler-window", "10"], "--straggler-window 10 does not apply under --fault-tolerance"),
    (["--straggler-threshold", "2"], "--straggler-threshold 2.0 does not apply under --fault-tolerance"),
    (["--parallel", "pp=2", "-n", "2", "--task", "lm", "--pipeline-schedule", "gpipe"],
     "--pipeline-schedule with --parallel pp=2 does not apply under --fault-tolerance"),
    (["--parallel", "dp_shard=2", "-n", "2", "--fsdp-wrap", "none"], "--fsdp-wrap with --parallel dp_shard=2 does not apply"),
    (["--master-port", "29999"], "--master-port 29999 does not apply under --fault-tolerance"),
    (["--local-addr", "127.0.0.1"], "--local-addr 127.0.0.1 does not apply under --fault-tolerance"),
    (["--startup-timeout", "30"], "--startup-timeout 30.0 does not apply under --fault-tolerance"),
    (["--launcher", "spawn"], "--launcher spawn does not apply under --fault-tolerance"),
    (["--rdzv-last-call", "1"], "--rdzv-last-call 1.0 does not apply under --fault-tolerance"),
    (["--stall-timeout", "5"], "--stall-timeout 5.0 does not apply under --fault-tolerance"),
    (["--debug"], "--debug does not apply under --fault-tolerance"),
    (["--run-dir", "rd"], "--run-dir rd does not apply under --fault-tolerance"),
])
def test_train_refuses_a_flag_its_groups_would_ignore(flags, says, capsys):
    assert says in _refused(["train", "--fault-tolerance", "--max-steps", "2", *flags], capsys)


@pytest.mark.parametrize("flags, says", [
    (["--comm", "fp16"], "--comm fp16 does not apply under --fault-tolerance"),
    (["--comm-warmup", "3"], "--comm-warmup 3 does not apply under --fault-tolerance"),
    (["--parallel", "tp=2"], "--parallel tp=2 does not apply under --fault-tolerance"),
    (["--local-rank-arg=--local_rank"], "--local-rank-arg --local_rank does not apply under --fault-tolerance"),
    (["--master-port", "29999"], "--master-port 29999 does not apply under --fault-tolerance"),
    (["--stall-timeout", "5"], "--stall-timeout 5.0 does not apply under --fault-tolerance"),
])
def test_run_refuses_a_flag_its_script_groups_would_ignore(flags, says, capsys):
    assert says in _refused(["run", "--fault-tolerance", *flags, SCRIPT], capsys)


@pytest.mark.parametrize("argv, says", [
    (["train", "--lighthouse", "127.0.0.1:29510"], "--lighthouse 127.0.0.1:29510 applies to a fault-tolerant job only"),
    (["train", "--replica-id", "b"], "--replica-id b applies to a fault-tolerant job only"),
    (["run", "--replica-id", "b", SCRIPT], "--replica-id b applies to a fault-tolerant job only"),
])
def test_a_fault_tolerant_jobs_flag_without_fault_tolerance_is_refused(argv, says, capsys):
    assert says in _refused(argv, capsys)


def test_the_flags_that_work_pass_the_checks(tmp_path):
    args = build_parser().parse_args([
        "train", "--fault-tolerance", "--num-workers", "0", "--no-breakdown", "--async-save", "--checkpoint-dir", str(tmp_path / "c"),
        "--tensorboard", str(tmp_path / "tb"), "--metrics-file", str(tmp_path / "m.jsonl"), "--log-every", "5",
        "--strategy", "fsdp", "--fsdp-wrap", "none", "-n", "2", "--max-restarts", "2", "--verbose"])
    refuse_unsupported(config_from_args(args), args.elastic_batch)
    _refuse_launch_flags(args)  # the launch flags' defaults are not taken for given values
    script = build_parser().parse_args(["run", "--fault-tolerance", "-n", "2", "--max-restarts", "1", SCRIPT])
    _refuse_launch_flags(script)
