"""The dry run's trackers and meta handling, without a process group: the tensors' peak (made,
freed, resized storages), collectives grouped by kind and dimension, meta tensors kept on meta
through ``.to(device)``, and ties kept through ``to_empty``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.dryrun.rank import KeepMeta, stand_in_values
from dtrain.dryrun.track import Call, TensorMemory, _group_name, summarise

MIB = 2**20


@pytest.mark.timeout(60)
def test_tensor_memory_counts_live_storages_and_their_peak():
    held = torch.zeros(MIB // 4)  # 1 MiB made before: counted once registered
    mem = TensorMemory()
    mem.hold([held, held.view(2, -1)])  # a view shares the storage: not counted twice
    assert mem.live == MIB
    with mem:
        a = torch.ones(MIB // 2)  # +2 MiB
        b = a * 2  # +2 MiB: peak 5 MiB
        del a, b
        c = torch.ones(MIB // 4)  # +1 MiB after both were freed
    assert mem.peak == 5 * MIB
    assert mem.live == 2 * MIB
    del c


@pytest.mark.timeout(60)
def test_tensor_memory_follows_storage_resize_as_fsdp2_frees_and_regathers():
    original = torch.UntypedStorage.resize_
    mem = TensorMemory()
    with mem:
        buf = torch.empty(MIB // 4)  # 1 MiB
        buf.untyped_storage().resize_(0)  # FSDP2 frees an all-gathered parameter this way
        assert mem.live == 0
        buf.untyped_storage().resize_(2 * MIB)  # and allocates it again
        assert mem.live == 2 * MIB
    assert mem.peak == 2 * MIB
    assert torch.UntypedStorage.resize_ is original  # given back on exit


@pytest.mark.timeout(60)
def test_collectives_are_grouped_by_kind_and_dimension_with_counts_and_bytes():
    calls = [Call("all_gather", "dp_shard", 10), Call("reduce_scatter", "dp_shard", 4), Call("all_gather", "dp_shard", 6),
             Call("all_gather", "tp", 1)]
    assert summarise(calls) == [{"kind": "all_gather", "dim": "dp_shard", "count": 2, "bytes": 16},
                                {"kind": "reduce_scatter", "dim": "dp_shard", "count": 1, "bytes": 4},
                                {"kind": "all_gather", "dim": "tp", "count": 1, "bytes": 1}]


@pytest.mark.timeout(60)
def test_functional_collective_group_is_its_last_name_not_the_reduce_op():
    t = torch.zeros(2)
    assert _group_name((t, "sum", "17"), {}) == "17"  # all_reduce(input, reduce_op, group_name)
    assert _group_name((t, "avg", 4, "3"), {}) == "3"  # reduce_scatter_tensor(input, op, group_size, group_name)


@pytest.mark.timeout(60)
def test_keep_meta_leaves_a_meta_model_on_meta_through_to_device():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with KeepMeta():
        model.to("cpu")
        assert model.weight.is_meta
    with pytest.raises(NotImplementedError):
        model.to("cpu")  # what the apply path's model.to(device) would do without it


@pytest.mark.timeout(60)
def test_stand_in_values_allocate_a_meta_model_and_keep_its_ties():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    model[2].weight = model[0].weight  # a head tied to its embedding
    stand_in_values(model, torch.device("cpu"))
    assert model[2].weight is model[0].weight
    assert len(list(model.parameters())) == 3
    assert torch.all(model[1].weight == 1) and torch.all(model[1].bias == 0)
    assert 0 < float(model[0].weight.detach().std()) < 0.1
