"""The data position a DeviceLoader reports (what a checkpoint stores as ``loader``): saved again
before its first batch after a resume, it is the position resumed from (issue 51: an elastic
restart from the last checkpoint saved the final one again with ``samples_consumed`` 0)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dtrain.data.loader import DeviceLoader, reshard

N, BATCH, WORLD = 40, 4, 2  # 5 steps per epoch on 2 ranks


def _loader(rank: int = 0, n: int = N) -> DeviceLoader:
    data = TensorDataset(torch.arange(n))
    return DeviceLoader(reshard(DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True), rank=rank,
                                world_size=WORLD, seed=3), torch.device("cpu"), on_last=lambda _: None, world_size=WORLD)


def _run(loader: DeviceLoader, steps: int) -> list[dict[str, int]]:
    """The position after each of ``steps`` batches, over as many epochs as it takes (as the loop runs)."""
    states: list[dict[str, int]] = []
    while len(states) < steps:
        for _ in loader:
            states.append(loader.state_dict())
            if len(states) == steps:
                break
    return states


@pytest.mark.parametrize("n", [N, N + 2])  # N + 2: drop_last leaves 2 samples at each epoch's end
@pytest.mark.parametrize("at", range(0, 13))
def test_a_resumed_loader_saved_before_its_first_batch_keeps_the_position(at, n):
    reference = _run(_loader(n=n), 13)
    saved = reference[at - 1] if at else _loader(n=n).state_dict()
    resumed = _loader(n=n)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved  # was {"epoch": 0, "samples_consumed": 0} before the first batch
    assert _run(resumed, 13 - at) == reference[at:]  # and it goes on as the uninterrupted loader did


def test_loading_during_an_iteration_reports_the_loaded_position_not_the_old_one():
    loader = _loader()
    _run(loader, 3)  # an iteration left in progress, 3 batches in
    loader.load_state_dict({"epoch": 2, "samples_consumed": 16, "seed": 3})
    assert loader.state_dict() == {"epoch": 2, "samples_consumed": 16, "seed": 3}
    assert next(iter(loader))[0].tolist() == _loader().sampler.global_order(2)[16:][0::WORLD][:BATCH]


def test_positions_before_during_and_after_an_epoch():
    loader = _loader()
    assert loader.state_dict() == {"epoch": 0, "samples_consumed": 0, "seed": 3}
    states = _run(loader, 5)
    assert [s["samples_consumed"] for s in states[:4]] == [8, 16, 24, 32]
    assert states[4] == {"epoch": 1, "samples_consumed": 0, "seed": 3}  # the epoch's last batch: the next one's start
    assert loader.state_dict() == {"epoch": 1, "samples_consumed": 0, "seed": 3}
