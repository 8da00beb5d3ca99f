"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""

import re

import pytest
import torch

import dtrain
from dtrain import CheckpointError, ConfigError, Precision, strategies
from dtrain.checkpoint import atomic_save, safe_load
from dtrain.launch import LaunchSpec
from dtrain.tasks import load_task
from dtrain.train import TrainConfig
from dtrain.train.config import BatchConfig


def test_precision_presets_on_cpu():
    cpu = torch.device("cpu")
    assert Precision.resolve("fp32", cpu).autocast_dtype is None
    assert Precision.resolve("bf16-mixed", cpu).autocast_dtype == torch.bfloat16
    fp16 = Precision.resolve("fp16-mixed", cpu)
    assert fp16.autocast_dtype == torch.bfloat16 and not fp16.scale_loss and fp16.effective == "bf16-mixed"
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        Precision.resolve("fp8", cpu)


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown strategy 'fdsp'; choose one of: .*ddp.*single"):
        strategies.build("fdsp")


def test_batch_not_divisible_by_accum():
    with pytest.raises(ConfigError, match=r"--batch-size 48 is not divisible by --grad-accum 5; use a multiple of 5 \(e.g. 45 or 50\)"):
        TrainConfig(batch=BatchConfig(size=48, grad_accum=5))


@pytest.mark.parametrize("kwargs, msg", [({"nproc": 0}, "-n/--nproc must be >= 1, got 0"),
                                          ({"nnodes": 2}, "needs --master-addr"),
                                          ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "outside 0..1"),
                                          ({"launcher": "mpirun"}, "unknown launcher"),
                                          ({"launcher": "spawn", "max_restarts": 1}, "needs --launcher torchrun")])
def test_launch_spec_validation(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        LaunchSpec(**kwargs)


def test_atomic_save_and_safe_load(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"w": torch.ones(3), "step": 4}, path)
    assert safe_load(path)["step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temporary file left behind"


def test_safe_load_refuses_truncated_and_pickles(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="c.pt cannot be read"):
        safe_load(path)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt"):
        safe_load(tmp_path / "evil.pt")


def test_digits_task_and_unknown_task():
    task = load_task("digits")
    assert len(task.train_set) + len(task.test_set) == 1797
    with pytest.raises(ConfigError, match="unknown task 'imagenet'"):
        load_task("imagenet")
    with pytest.raises(ConfigError, match="takes no option 'depth'"):
        load_task("digits", options={"depth": "3"})


def test_user_task_from_module_function():
    task = load_task("tests.user_task:make", options={"hidden": "8"})
    assert task.name == "tests.user_task:make"
    assert task.build_model()[0].out_features == 8


def test_context_single_process_basics():
    ctx = dtrain.init()
    assert (ctx.rank, ctx.world_size, ctx.strategy.name) == (0, 1, "single")
    t = torch.tensor([2.0])
    assert ctx.all_reduce(t, op="mean").item() == 2.0
    with pytest.raises(ConfigError, match="unknown reduce op"):
        ctx.all_reduce(t, op="avg")
    model = ctx.setup(torch.nn.Linear(2, 2))
    assert set(model.state_dict()) == {"weight", "bias"}, "no wrapper prefixes in state_dict"
    ctx.close()


def test_accumulation_window_cut_by_end_of_epoch_still_syncs():
    from torch.utils.data import DataLoader, TensorDataset

    ctx = dtrain.init()
    model = ctx.setup(torch.nn.Linear(1, 1))
    loader = ctx.setup_dataloader(DataLoader(TensorDataset(torch.ones(3, 1)), batch_size=1))
    for _epoch in range(2):
        flags = []
        for _ in loader:
            with ctx.accumulate(model, steps=2):
                flags.append(ctx.sync_gradients)
        assert flags == [False, True, True]  # a new epoch starts a new window
    ctx.close()


def test_train_config_sections_validate_themselves():
    import dataclasses

    from dtrain.comm import CommSpec
    from dtrain.train import config as tc

    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(tc.SECTIONS)
    for kwargs, section, msg in [({"grad_accum": 0}, tc.BatchConfig, "--grad-accum must be >= 1, got 0"),
                                 ({"max_steps": 0}, tc.ScheduleConfig, "--max-steps must be >= 1, got 0"),
                                 ({"save_every": 5}, tc.CheckpointConfig, "--save-every needs --checkpoint-dir"),
                                 ({"lr": -1.0}, tc.OptimConfig, "--lr must be > 0"),
                                 ({"log_every": 0}, tc.ObserveConfig, "--log-every must be >= 1, got 0"),
                                 ({"comm": "fp16"}, tc.ParallelConfig, "give a CommSpec"),
                                 ({"layout": "tp=2", "strategy": "fsdp"}, tc.ParallelConfig, "both say how to split the ranks")]:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            section(**kwargs)
    with pytest.raises(ConfigError, match=r"--max-steps 3 ends the run before step 5"):  # the one check across sections
        TrainConfig(schedule=tc.ScheduleConfig(max_steps=3), observe=tc.ObserveConfig(trace="5:6"))
    cfg = TrainConfig(parallel=tc.ParallelConfig(comm=CommSpec.parse("fp16", warmup=3)))
    assert cfg.parallel.comm.warmup == 3 and cfg.batch == tc.BatchConfig()
