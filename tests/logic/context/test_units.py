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
