"""The lm task's ``vocab`` and ``ffn`` options: a published model's shape (dtrain plan and dtrain
dry-run build it on the meta device), checked where they enter."""

from __future__ import annotations

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.tasks import load_task


@pytest.mark.timeout(60)
def test_vocab_and_ffn_shape_the_model():
    task = load_task("lm", options={"vocab": "1000", "ffn": "96", "width": "32", "heads": "2", "layers": "1",
                                    "context": "16", "max_bytes": "20000", "tie": "false"})
    with torch.device("meta"):
        model = task.new_model()
    assert tuple(model.embed.tok.weight.shape) == (1000, 32)
    assert tuple(model.head.out.weight.shape) == (1000, 32)
    assert tuple(model.block0.mlp[0].weight.shape) == (96, 32)
    default = load_task("lm", options={"width": "32", "heads": "2", "layers": "1", "context": "16", "max_bytes": "20000"})
    with torch.device("meta"):
        assert tuple(default.new_model().block0.mlp[0].weight.shape) == (128, 32)  # 4 x width, as before


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("key", "value", "says"), [("vocab", "100", "vocab=100 is smaller than the 256"),
                                                    ("ffn", "-1", "ffn=-1 must be >= 1")])
def test_bad_vocab_or_ffn_is_one_line(key, value, says):
    with pytest.raises(ConfigError, match=says):
        load_task("lm", options={key: value, "max_bytes": "20000"})
