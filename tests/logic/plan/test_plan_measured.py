"""`dtrain plan`'s measured inputs, pure logic: link figures fitted from collective timings, the
layouts' own CPU cost from a world-of-one profile, and peak memory per rank; each against a hand
calculation (no process group)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims
from dtrain.plan import Settings, cluster, costs, predict
from dtrain.plan.layouts import Layout
from dtrain.plan.machinery import Machinery, Phases, kinds_for, kinds_of
from dtrain.plan.model import memory
from dtrain.plan.profile import Block, ModelProfile, Timing

MIB = 2**20


def _times(kind: str, lat: float, bw: float, n: int, sizes=(64, 256 << 10, 1 << 20)) -> dict[int, float]:
    steps, volume = costs.SHAPES[kind]
    return {b: steps(n) * lat + volume(n) * b / bw for b in sizes}


def test_fit_recovers_latency_and_bandwidth_of_each_collective():
    for kind in costs.SHAPES:
        for n in (2, 4):
            f = costs.fit(kind, _times(kind, 1e-3, 10e6, n), n)
            assert f.lat == pytest.approx(1e-3 + costs.SHAPES[kind][1](n) * 64 / 10e6 / costs.SHAPES[kind][0](n))
            assert f.bw == pytest.approx(10e6)


def test_a_measured_figure_reproduces_the_measured_time_and_scales_by_the_ring_shape():
    # gloo's all-gather at 2 ranks: 0.5 ms, then 1 MiB in 60 ms (1.45x its bytes' time at 12.5 MB/s)
    seconds = {64: 0.5e-3, 256 << 10: 0.0155, 1 << 20: 0.0605}
    f = costs.fit("all_gather", seconds, 2)
    assert f.seconds("all_gather", 1 << 20, 2) == pytest.approx(0.0605, rel=1e-3)
    # on 4 ranks: 3 latencies and 3/4 of the bytes (twice the 2-rank 1/2)
    assert f.seconds("all_gather", 1 << 20, 4) == pytest.approx(3 * f.lat + 0.75 * (1 << 20) / f.bw)


def test_noise_that_inverts_the_two_largest_sizes_still_gives_a_bandwidth():
    f = costs.fit("all_reduce", {64: 1e-3, 1000: 0.02, 2000: 0.019}, 2)
    assert f.bw == pytest.approx(2 * 2000 / 2 / (0.019 - 2 * 0.5e-3))


def test_a_record_round_trips_and_bad_files_are_one_line(tmp_path):
    secs = {k: _times(k, 1e-4, 1e8, 2) for k in costs.SHAPES}
    path = tmp_path / "links.json"  # as `dtrain doctor --links-out` writes it
    path.write_text(json.dumps({"between": "nodes", "ranks": 2, "backend": "gloo", "load": 1.5,
                                "seconds": {k: {str(b): s for b, s in v.items()} for k, v in secs.items()}}))
    back = costs.load(str(path))
    assert back.between == "nodes" and back.figures["send_recv"].bw == pytest.approx(1e8)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        costs.load(str(path))
    path.write_text('{"between": "racks", "ranks": 2, "seconds": {}}')
    with pytest.raises(ConfigError, match="between 'processes' or 'nodes'"):
        costs.load(str(path))
    with pytest.raises(ConfigError, match="cannot be read"):
        costs.load(str(tmp_path / "missing.json"))


def test_measured_links_replace_the_described_ones_where_measured():
    c = cluster.build({"device": "cpu", "nodes": 2, "procs_per_node": 2, "inter_gbit": 1.0, "inter_latency_us": 100})
    secs = {"all_reduce": _times("all_reduce", 2e-3, 5e6, 2)}
    m = cluster.with_links(c, {"inter": costs.from_measurement(secs, ranks=2, between="nodes", backend="gloo")})
    assert m.figure("all_reduce", True).bw == pytest.approx(5e6)
    assert m.figure("all_reduce", True, sharing=2).bw == pytest.approx(2.5e6)  # two groups share the node's link
    assert m.figure("all_gather", True).bw == pytest.approx(c.inter_bw)  # not measured: as described
    assert m.figure("all_reduce", False).bw == pytest.approx(c.intra_bw)
    assert "links_inter" in m.source
    g = costs.Group(2, 1)
    assert costs.allreduce(1 << 20, g, m) == pytest.approx(_times("all_reduce", 2e-3, 5e6, 2)[1 << 20], rel=1e-3)


def test_a_measured_gloo_reduce_scatter_is_used_as_measured():
    c = cluster.build({"device": "cpu", "nodes": 2, "procs_per_node": 1})
    g = costs.Group(2, 1)
    assert costs.gather(1e6, g, c, reduce=True) == pytest.approx(costs.allreduce(1e6, g, c))  # the unmeasured rule
    secs = {"reduce_scatter": _times("reduce_scatter", 1e-3, 2e6, 2)}
    m = cluster.with_links(c, {"inter": costs.from_measurement(secs, ranks=2, between="nodes", backend="gloo")})
    assert costs.gather(1e6, g, m, reduce=True) == pytest.approx(1e-3 + 0.5 * 1e6 / 2e6, rel=1e-3)


def test_broadcasts_pay_a_latency_per_message_and_gloo_a_tree():
    c = cluster.build({"device": "cpu", "nodes": 4, "procs_per_node": 1, "inter_gbit": 8e-3 * 8, "inter_latency_us": 1000})
    bw = c.inter_bw
    assert costs.broadcast(1e6, costs.Group(2, 1), c, messages=10) == pytest.approx(10 * 1e-3 + 1e6 / bw)
    assert costs.broadcast(1e6, costs.Group(4, 1), c) == pytest.approx(2 * (1e-3 + 1e6 / bw))  # two rounds of a binomial tree


def _span(f: float, b: float, group: costs.Group, c, **kw) -> float:
    """A pipeline of two, 4 micro-batches of 200 bytes, played out on ``group``'s link in ``c``."""
    from dtrain.plan.steps import makespan

    return makespan(2, 4, f, b, costs.p2p(200, group, c), latency=costs.p2p(1, group, c), **kw)


def _machinery(**steps: tuple[float, float, float]) -> Machinery:
    base = {"plain": Phases(0.010, 0.020, 0.002)}
    base.update({k: Phases(*v) for k, v in steps.items()})
    return Machinery(batch=8, microbatches=4, steps=base, rounds=5,
                     rss={"baseline": 600 * MIB, "plain_peak": 10 * MIB})


def _prof(m: Machinery | None = None) -> ModelProfile:
    blocks = tuple(Block(params=100_000, fwd_flops=1e6, act_bytes=1000.0, out_bytes=100.0) for _ in range(2))
    t = Timing(batch=8, fwd_s=0.010, bwd_s=0.020, opt_s=0.002, threads=1, device="cpu")
    return ModelProfile(name="toy", params=250_000, fwd_flops=2.5e6, act_bytes=2500.0, blocks=blocks, matrices=((500, 500),),
                        tensors=6, timing=t, machinery=m)


def _cpu(nodes=2):
    c = cluster.build({"device": "cpu", "nodes": nodes, "procs_per_node": 1, "inter_gbit": 1.0, "inter_latency_us": 0})
    return replace(c, device=cluster.cpu_device(1e9, 64 * 2**30))


def test_each_layout_maps_to_the_kinds_it_pays():
    d = ParallelDims
    assert kinds_of(Layout("ddp", d(dp_replicate=2), comm="bf16")) == ["ddp:bf16"]
    assert kinds_of(Layout("zero1", d(dp_replicate=2), zero1=True)) == ["zero1"]
    assert kinds_of(Layout("fsdp", d(dp_shard=2))) == ["fsdp"]
    assert kinds_of(Layout("dp_shard=2,tp=2", d(dp_shard=2, tp=2))) == ["tp", "fsdp"]
    assert kinds_of(Layout("dp_replicate=2,tp=2", d(dp_replicate=2, tp=2))) == ["tp"]
    assert kinds_of(Layout("pp=2", d(pp=2))) == []
    assert kinds_for([Layout("pp=2", d(pp=2)), Layout("ddp", d(dp_replicate=2))]) == ["micro", "pp", "ddp:none"]


def test_the_measured_extra_is_added_per_phase_and_noise_below_plain_is_none():
    m = _machinery(**{"ddp:none": (0.009, 0.023, 0.003), "fsdp": (0.015, 0.030, 0.012)})
    assert m.extra("ddp:none") == Phases(0.0, pytest.approx(0.003), pytest.approx(0.001))
    c, s = _cpu(), Settings(batch=8)
    bare = predict(_prof(), c, Layout("fsdp", ParallelDims(dp_shard=2)), s)
    measured = predict(_prof(m), c, Layout("fsdp", ParallelDims(dp_shard=2)), s)
    assert measured.phases_s["forward"] - bare.phases_s["forward"] == pytest.approx(0.005)
    assert measured.phases_s["backward"] - bare.phases_s["backward"] == pytest.approx(0.010)
    assert measured.phases_s["optimizer"] - bare.phases_s["optimizer"] == pytest.approx(0.010)


def test_powersgd_compute_is_the_measured_one():
    m = _machinery(**{"ddp:powersgd:2": (0.010, 0.030, 0.002)})
    c, s = _cpu(), Settings(batch=8)
    psgd = Layout("ddp", ParallelDims(dp_replicate=2), comm="powersgd:2")
    bare, measured = predict(_prof(), c, psgd, s), predict(_prof(m), c, psgd, s)
    assert measured.phases_s["backward"] - bare.phases_s["backward"] == pytest.approx(0.010)
    assert measured.phases_s["exposed_comm"] == bare.phases_s["exposed_comm"] == pytest.approx(measured.comm_s)


def test_a_pipeline_slot_is_a_measured_micro_batch_plus_the_schedules_own_work():
    # one micro-batch of 2: 4 + 6 ms; the one-stage schedule of 4 micro-batches took 48 ms: 2 ms each of its own
    m = replace(_machinery(micro=(0.004, 0.006, 0.0), pp=(0.048, 0.0, 0.002)))
    p = predict(_prof(m), _cpu(), Layout("pp=2", ParallelDims(pp=2)), Settings(batch=8, microbatches=4))
    share = (1e6 + 0.5e6 / 2) / 2.5e6  # the busiest stage: one block and half the rest's FLOPs
    assert p.phases_s["forward"] == pytest.approx(4 * (0.004 * share + 0.002))
    assert p.phases_s["backward"] == pytest.approx(4 * 0.006 * share)
    per_mb = (p.phases_s["forward"] + p.phases_s["backward"]) / 4
    assert p.phases_s["bubble"] == pytest.approx(per_mb)


def test_cpu_peak_memory_is_the_workers_baseline_plus_state_activations_and_the_measured_transient():
    m = _machinery()
    prof, c, s = _prof(m), _cpu(), Settings(batch=8, optimizer="adam")
    mem = memory(prof, c, Layout("ddp", ParallelDims(dp_replicate=2)), s)
    modelled = 4 * 250_000 * 3 + 2500.0 * 8  # gradients, Adam's two moments, activations
    assert mem["baseline"] == 600 * MIB and mem["transient"] == pytest.approx(10 * MIB - modelled)
    p = predict(prof, c, Layout("ddp", ParallelDims(dp_replicate=2)), s)
    assert p.peak_bytes == p.mem_bytes == pytest.approx(sum(mem.values()))
    assert p.state_bytes == pytest.approx(4 * 250_000 * 4)
    row = p.as_dict(2)
    assert row["peak_mib_per_rank"] == round(p.peak_bytes / MIB, 1) and row["state_mib_per_rank"] == round(p.state_bytes / MIB, 2)


def test_gpu_peak_is_the_allocators_without_the_context_and_holds_the_outputs_gradient():
    prof = replace(_prof(), out_bytes=1000.0, timing=None)
    c = cluster.build({"device": "h100", "nodes": 1, "procs_per_node": 2})
    p = predict(prof, c, Layout("ddp", ParallelDims(dp_replicate=2)), Settings(batch=8))
    assert p.memory["transient"] == 8000.0 and "baseline" not in p.memory
    assert p.peak_bytes == pytest.approx(p.mem_bytes - c.device.fixed_bytes)


def test_a_log_step_costs_its_collectives_amortised_over_log_every():
    """Every --log-every steps: the loss's mean and the preemption check (one number each), then
    the breakdown's all-gather; on one process nothing."""
    from dtrain.metrics.breakdown import STAT_KEYS
    from dtrain.plan.steps import log_step

    c = replace(_cpu(), inter_lat=0.002)
    g = costs.Group(2, 1)
    once = 2 * costs.allreduce(4, g, c) + costs.gather(2 * (2 * len(STAT_KEYS) + 2) * 8, g, c)
    assert log_step(c, Settings(batch=8)) == pytest.approx(once) and once > 4 * 0.002
    ddp = Layout("ddp", ParallelDims(dp_replicate=2))
    for every in (1, 10, 20):
        assert predict(_prof(), c, ddp, Settings(batch=8, log_every=every)).phases_s["log"] == pytest.approx(once / every)
    assert predict(_prof(), _cpu(1), Layout("single", ParallelDims()), Settings(batch=8)).phases_s["log"] == 0.0
