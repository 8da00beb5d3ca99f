"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""

import re

import pytest

from dtrain import ConfigError
from dtrain.train import TrainConfig
from dtrain.train.config import BatchConfig


def test_batch_not_divisible_by_accum():
    with pytest.raises(ConfigError, match=r"--batch-size 48 is not divisible by --grad-accum 5; use a multiple of 5 \(e.g. 45 or 50\)"):
        TrainConfig(batch=BatchConfig(size=48, grad_accum=5))


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
