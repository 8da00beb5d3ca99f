"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest
import torch

from dtrain import ConfigError, Precision


def test_precision_presets_on_cpu():
    cpu = torch.device("cpu")
    assert Precision.resolve("fp32", cpu).autocast_dtype is None
    assert Precision.resolve("bf16-mixed", cpu).autocast_dtype == torch.bfloat16
    fp16 = Precision.resolve("fp16-mixed", cpu)
    assert fp16.autocast_dtype == torch.bfloat16 and not fp16.scale_loss and fp16.effective == "bf16-mixed"
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        Precision.resolve("fp8", cpu)
