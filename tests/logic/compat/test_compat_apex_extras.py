"""apex's optimizers, fp16_utils and multi_tensor_apply (one process, tiny tensors)."""

from __future__ import annotations

import pytest
import torch

import dtrain
from dtrain.compat.apex import fp16_utils, optimizers
from dtrain.compat.apex.multi_tensor_apply import amp_C, multi_tensor_applier


def _fit(make_opt, steps: int = 60) -> tuple[float, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    opt = make_opt(model.parameters())
    first = None
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return first, loss.item()


@pytest.mark.parametrize("name, kwargs", [("FusedAdam", dict(lr=0.05)), ("FusedSGD", dict(lr=0.1, momentum=0.9)),
                                          ("FusedLAMB", dict(lr=0.05)), ("FusedNovoGrad", dict(lr=0.05)),
                                          ("FusedAdagrad", dict(lr=0.1))])
def test_each_apex_optimizer_lowers_the_loss(name, kwargs):
    first, last = _fit(lambda ps: getattr(optimizers, name)(ps, **kwargs))
    assert last < 0.8 * first, (name, first, last)


def test_fused_adam_is_torch_adamw_with_apex_defaults():
    a = _fit(lambda ps: optimizers.FusedAdam(ps, lr=0.01, weight_decay=0.1), steps=5)
    b = _fit(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-8), steps=5)
    assert a == pytest.approx(b, rel=1e-6)
    with pytest.raises(dtrain.ConfigError, match="wd_after_momentum"):
        optimizers.FusedSGD([torch.zeros(1, requires_grad=True)], lr=0.1, wd_after_momentum=True)


def test_fp16_optimizer_steps_fp32_masters_and_skips_overflow():
    assert fp16_utils.to_python_float(torch.tensor([2.5])) == 2.5
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD([w], lr=0.5), dynamic_loss_scale=True,
                                     dynamic_loss_args={"init_scale": 128.0})
    opt.backward((w.float() * 2).sum())
    opt.step()
    assert w.tolist() == [0.0, 0.0, 0.0] and opt.param_groups[0]["params"][0].dtype == torch.float32
    scale = opt.loss_scale
    opt.zero_grad()
    opt.backward((w.float() * float("inf")).sum())
    opt.step()  # overflow: skipped, scale halved
    assert w.tolist() == [0.0, 0.0, 0.0] and opt.loss_scale == scale / 2


def test_multi_tensor_applier_scale_and_norm():
    flag = torch.zeros(1, dtype=torch.int)
    src, dst = [torch.ones(2), torch.full((3,), 2.0)], [torch.zeros(2), torch.zeros(3)]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.5)
    assert [d.tolist() for d in dst] == [[0.5, 0.5], [1.0, 1.0, 1.0]] and flag.item() == 0
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [src], True)
    assert total.item() == pytest.approx((2 + 12) ** 0.5) and per.tolist() == pytest.approx([2 ** 0.5, 12 ** 0.5])
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[torch.tensor([float("nan")])], [torch.zeros(1)]], 1.0)
    assert flag.item() == 1
