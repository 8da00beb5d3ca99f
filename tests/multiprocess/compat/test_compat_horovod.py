"""dtrain.compat.horovod's API groups on 2 processes: async handles and barrier, grouped and
in-place ops, alltoall/reducescatter, process sets, join, reduce ops and dtypes, autograd,
compressors, re-init, and a mismatch raising on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.support import run_distributed


def async_grouped_and_barrier() -> dict:
    import dtrain.compat.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    h = hvd.allreduce_async(torch.full((64,), float(r + 1)), op=hvd.Sum, name="a")
    with pytest.raises(ValueError, match="still in flight"):
        hvd.allreduce_async(torch.ones(1), name="a")
    out["async"] = hvd.synchronize(h)
    assert hvd.poll(h)
    out["grouped"] = hvd.grouped_allreduce([torch.ones(2), torch.full((3,), float(r))], op=hvd.Sum)
    ts = [torch.ones(2), torch.ones(3)]
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    out["grouped_"] = ts
    out["ops"] = {name: hvd.allreduce(torch.tensor([r + 2, 3 - r], dtype=torch.int16), op=getattr(hvd, name))
                  for name in ("Min", "Max", "Product", "Sum", "Average")}
    out["bool"] = hvd.allreduce(torch.tensor([r == 0, False]), op=hvd.Sum)
    out["prescale_int"] = hvd.allreduce(torch.tensor([3], dtype=torch.int32), op=hvd.Sum, prescale_factor=0.5)
    out["int8_gather"] = hvd.allgather(torch.full((r + 1,), r - 1, dtype=torch.int8))
    hvd.barrier()
    hvd.shutdown()
    hvd.init()  # again, after shutdown
    out["reinit"] = (hvd.rank(), hvd.size())
    hvd.shutdown()
    return out


def _every_group() -> dict:
    """The three API groups below one after another in the same 2 processes (hvd.init() after
    hvd.shutdown() joins the same process group again): starting the processes is most of each
    group's time on 2 cores. The mismatch goes last, so a rank it left behind fails no other group."""
    return {"async": async_grouped_and_barrier(), "movement": movement_sets_join_and_grads(), "mismatch": mismatch_then_recover()}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_every_group, world_size=2, timeout=200)


@pytest.mark.slow  # ~10 s alone; 2 processes, each with 3 process groups
@pytest.mark.timeout(220)
def test_async_grouped_ops_dtypes_and_reinit(runs):
    res = [r["async"] for r in runs]
    for r, out in enumerate(res):
        assert torch.equal(out["async"], torch.full((64,), 3.0))
        assert [t.tolist() for t in out["grouped"]] == [[2.0, 2.0], [1.0, 1.0, 1.0]]
        assert [t.tolist() for t in out["grouped_"]] == [[2.0, 2.0], [2.0, 2.0, 2.0]]
        ops = {k: v.tolist() for k, v in out["ops"].items()}
        assert ops == {"Min": [2, 2], "Max": [3, 3], "Product": [6, 6], "Sum": [5, 5], "Average": [2, 2]}
        assert out["ops"]["Sum"].dtype == torch.int16
        assert out["bool"].tolist() == [True, False]
        assert out["prescale_int"].tolist() == [2]  # int(3 * 0.5) = 1 on each rank, as Horovod scales in fp64
        assert out["int8_gather"].tolist() == [-1, 0, 0]
        assert out["reinit"] == (r, 2)


def movement_sets_join_and_grads() -> dict:
    import dtrain.compat.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    x = torch.arange(4.0) + 10 * r
    out["alltoall"], out["splits"] = hvd.alltoall(x, torch.tensor([1, 3], dtype=torch.int32))
    out["rs"] = hvd.reducescatter(torch.arange(6.0).reshape(3, 2), op=hvd.Sum)
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]  # the same calls on every rank
    solo, both = sets[r], hvd.add_process_set(hvd.ProcessSet([0, 1]))
    out["solo"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=solo)
    out["both"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=both)
    hvd.barrier(both)
    assert all(hvd.remove_process_set(ps) for ps in (*sets, both))
    out["objects"] = hvd.allgather_object({"r": r})
    if r == 0:
        out["join"] = hvd.join()
    else:
        out["uneven"] = hvd.allreduce(torch.tensor([4.0]), op=hvd.Sum)
        out["join"] = hvd.join()
    t = torch.ones(3, requires_grad=True)
    hvd.allreduce(t, op=hvd.Sum).sum().backward()
    out["grad"] = t.grad
    c, ctx = hvd.Compression.fp16.compress(torch.ones(2))
    out["fp16"] = (c.dtype, hvd.Compression.fp16.decompress(c, ctx).dtype)
    hvd.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(220)
def test_alltoall_reducescatter_process_sets_join_autograd_compression(runs):
    res = [r["movement"] for r in runs]
    assert res[0]["alltoall"].tolist() == [0.0, 10.0] and res[0]["splits"].tolist() == [1, 1]
    assert res[1]["alltoall"].tolist() == [1.0, 2.0, 3.0, 11.0, 12.0, 13.0] and res[1]["splits"].tolist() == [3, 3]
    assert res[0]["rs"].tolist() == [[0.0, 2.0], [4.0, 6.0]] and res[1]["rs"].tolist() == [[8.0, 10.0]]
    for r, out in enumerate(res):
        assert out["solo"].tolist() == [float(r)] and out["both"].tolist() == [1.0]
        assert out["objects"] == [{"r": 0}, {"r": 1}]
        assert out["join"] == 1  # rank 1 joined last, and every rank says so
        assert out["grad"].tolist() == [2.0, 2.0, 2.0]
        assert out["fp16"] == (torch.float16, torch.float32)
    assert res[1]["uneven"].tolist() == [4.0]  # the joined rank added zeros


def mismatch_then_recover() -> list[str]:
    import dtrain.compat.horovod as hvd

    hvd.init()
    r = hvd.rank()
    seen = []
    for bad in (torch.ones(3 + r), torch.ones(3, dtype=torch.int32 if r else torch.float32)):
        with pytest.raises(hvd.HorovodInternalError) as info:
            hvd.allreduce(bad)
        seen.append(str(info.value))
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2), root_rank=r)
    seen.append(str(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()))  # the ranks still agree afterwards
    if r == 1:  # the ranks go apart (as after a failure on rank 0 only) and meet again at the barrier
        with pytest.raises(hvd.HorovodInternalError) as info:
            hvd.allreduce(torch.ones(2))
        seen.append(str(info.value))
    hvd.barrier()
    seen.append(str(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()))
    hvd.shutdown()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(220)
def test_mismatch_raises_on_every_rank_and_the_job_goes_on(runs):
    """Also: a rank that waits in barrier() fails the others' operations, so they meet there."""
    res = [r["mismatch"] for r in runs]
    for seen in res:
        assert "rank 0: allreduce(float32[3]" in seen[0] and "rank 1: allreduce(float32[4]" in seen[0]
        assert "int32" in seen[1]
        assert seen[2] == "[2.0, 2.0]"
        assert seen[-1] == "[2.0, 2.0]"
    assert "rank(s) [0] wait in hvd.barrier()" in res[1][3]
