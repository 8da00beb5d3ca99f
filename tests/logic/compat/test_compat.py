"""Horovod- and apex-shaped APIs, and the hvd/dp strategies, against DDP."""

from __future__ import annotations

import pytest
import torch

import dtrain
from tests.multiprocess.strategies.test_ddp import _data, _model  # the same small regression problem


def test_apex_amp_levels_train_and_state_round_trips():
    from dtrain.compat.apex import amp

    for level in ("O0", "O1", "O2"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic")
        x, y = _data().tensors
        first = None
        for _ in range(20):
            out = model(x)
            assert out.dtype == torch.float32  # loss computed in fp32, as apex O1 does
            loss = torch.nn.functional.mse_loss(out, y)
            first = first if first is not None else loss.item()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert loss.item() < first, level
        assert len(list(amp.master_params(opt))) == 4
        state = amp.state_dict()
        assert set(state) == {"loss_scaler0"}
        amp.load_state_dict(state)
    with pytest.raises(dtrain.ConfigError, match="O3"):
        amp.initialize(_model(), opt_level="O3")


def test_apex_o1_uses_reduced_precision_on_cpu():
    from dtrain.compat.apex import amp

    seen = {}
    model = _model()
    model[0].register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype))  # returns None: output unchanged
    model = amp.initialize(model, opt_level="O1")
    model(torch.randn(4, 6))
    assert seen["dtype"] == torch.bfloat16  # fp16 levels run as bf16 on CPU


def test_dp_strategy_is_one_process_without_gpus(capsys):
    ctx = dtrain.init("dp")
    model = ctx.setup(_model())
    assert not isinstance(model.module, torch.nn.DataParallel)
    ctx.close()


# -- every method trains, and old scripts run unchanged ------------------------------------------

