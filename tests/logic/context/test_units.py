"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest
import torch

import dtrain
from dtrain import ConfigError


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


@pytest.mark.parametrize("wrapped", [False, True])
def test_fp16_loss_scaling_skips_an_overflowed_fused_sgd_step(wrapped):
    """torch's fused SGD, told the inf flag by the GradScaler, creates its momentum buffer
    uninitialised on a skipped step (an H200's fp16 run went NaN by step 10). dtrain's optimizer
    makes the scaler skip such a step itself: weights and state untouched, the next step finite.
    CPU has fused SGD and a GradScaler; the precision is fp16-mixed's, loss scaling included."""
    from dtrain.precision import Precision

    fp16 = Precision(name="fp16-mixed", autocast_dtype=torch.bfloat16, scale_loss=True, device_type="cpu")
    ctx = dtrain.init(precision=fp16)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    if wrapped:  # as a strategy's wrapper holds it (hvd's GradientAllReduceOptimizer)
        from dtrain.strategies.base import ForwardingOptimizer

        class Wrapper(ForwardingOptimizer):
            def step(self, closure=None):
                return self.optimizer.step(closure)

        opt = Wrapper(opt)
    model, opt = ctx.setup(net, opt)
    before = [p.detach().clone() for p in net.parameters()]
    ctx.backward(model(torch.randn(3, 4)).sum())
    net.weight.grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())), "an overflowed step changed the weights"
    assert not any(opt.state[p] for p in net.parameters()), "a skipped step left optimizer state behind"
    assert ctx.scaler.get_scale() == 2.0**15  # backed off once
    ctx.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert all(torch.isfinite(opt.state[p]["momentum_buffer"]).all() for p in net.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters())), "the finite step did not train"
    ctx.close()
