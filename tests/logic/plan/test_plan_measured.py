"""`dtrain plan`'s measured inputs, pure logic: link figures fitted from collective timings, the
layouts' own CPU cost from a world-of-one profile, and peak memory per rank; each against a hand
calculation (no process group)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims
from dtrain.plan import Settings, cluster, costs, links, predict
from dtrain.plan.layouts import Layout
from dtrain.plan.machinery import Machinery, Phases, kinds_for, kinds_of
from dtrain.plan.model import memory
from dtrain.plan.profile import Block, ModelProfile, Timing

MIB = 2**20


def _times(kind: str, lat: float, bw: float, n: int, sizes=(64, 256 << 10, 1 << 20)) -> dict[int, float]:
    steps, volume = links.SHAPES[kind]
    return {b: steps(n) * lat + volume(n) * b / bw for b in sizes}


def test_fit_recovers_latency_and_bandwidth_of_each_collective():
    for kind in links.SHAPES:
        for n in (2, 4):
            f = links.fit(kind, _times(kind, 1e-3, 10e6, n), n)
            assert f.lat == pytest.approx(1e-3 + links.SHAPES[kind][1](n) * 64 / 10e6 / links.SHAPES[kind][0](n))
            assert f.bw == pytest.approx(10e6)


def test_a_measured_figure_reproduces_the_measured_time_and_scales_by_the_ring_shape():
    # gloo's all-gather at 2 ranks: 0.5 ms, then 1 MiB in 60 ms (1.45x its bytes' time at 12.5 MB/s)
    seconds = {64: 0.5e-3, 256 << 10: 0.0155, 1 << 20: 0.0605}
    f = links.fit("all_gather", seconds, 2)
    assert f.seconds("all_gather", 1 << 20, 2) == pytest.approx(0.0605, rel=1e-3)
    # on 4 ranks: 3 latencies and 3/4 of the bytes (twice the 2-rank 1/2)
    assert f.seconds("all_gather", 1 << 20, 4) == pytest.approx(3 * f.lat + 0.75 * (1 << 20) / f.bw)


def test_a_link_whose_rate_depends_on_the_size_is_taken_at_each_measured_size():
    # 20 Mbit/s through tbf (the bed's lm-20m, run 8): 1 MiB at 18.5 Mbit/s, 4 MiB at 15 Mbit/s
    # (TCP loses more to the shaper's drops on a long transfer); one line from the two largest
    # sizes' difference put 548 KB at 314 ms where DDP's all-reduce of it took 231 ms
    mib = 1 << 20
    seconds = {64: 0.00466, mib: 0.457, 4 * mib: 2.230}
    f = links.fit("all_reduce", seconds, 2)
    for b, t in seconds.items():  # every measured size as measured (the smallest's 64 bytes count twice: within 1%)
        assert f.seconds("all_reduce", b, 2) == pytest.approx(t, rel=1e-2 if b == 64 else 1e-6)
    assert f.seconds("all_reduce", 548_000, 2) == pytest.approx(0.00466 + 548_000 / f.by_size[0][1], rel=1e-6)
    assert 0.23 < f.seconds("all_reduce", 548_000, 2) < 0.25
    mid = f.seconds("all_reduce", 2.5 * mib, 2)  # between the sizes: their rates interpolated
    assert seconds[mib] < mid < seconds[4 * mib]
    # beyond the largest size: its time, then the marginal rate for the bytes beyond
    assert f.seconds("all_reduce", 8 * mib, 2) == pytest.approx(2.230 + 4 * mib / f.bw, rel=1e-6)
    # on 4 ranks: 3x the latency steps, 1.5x the volume; and two groups sharing the NICs: half the rate
    assert f.seconds("all_reduce", mib, 4) == pytest.approx(6 * f.lat + 1.5 * (0.457 - 0.00466), rel=1e-6)
    assert f.shared(2).seconds("all_reduce", mib, 2) == pytest.approx(0.00466 + 2 * (0.457 - 0.00466), rel=1e-6)
    assert links.Links(between="nodes", ranks=2, backend="gloo", figures={"all_reduce": f}).describe()[
        "figures"]["all_reduce"]["gbit_per_s_by_size"] == {"1048576": 0.0185, "4194304": 0.0151}


def test_noise_that_inverts_the_two_largest_sizes_still_gives_a_bandwidth():
    f = links.fit("all_reduce", {64: 1e-3, 1000: 0.02, 2000: 0.019}, 2)
    assert f.bw == pytest.approx(2 * 2000 / 2 / (0.019 - 2 * 0.5e-3))


def test_two_sends_crossing_give_the_share_by_which_each_is_slowed_between_and_beyond_the_measured_sizes():
    import math

    from dtrain.diag.probe import CROSSED, CROSSED_LAG, one_way_at

    seconds = {"send_recv": _times("send_recv", 1e-4, 2.5e6, 2)}  # 20 Mbit/s

    def pair(b, share):  # the first send's time, the lag, and the overlapped rest slowed by share
        t = one_way_at(seconds["send_recv"], b)
        return (1 + CROSSED_LAG) * t + share * (1 - CROSSED_LAG) * t
    seconds[CROSSED] = {64 << 10: pair(64 << 10, 0.6), 1 << 20: pair(1 << 20, 0.4)}
    lk = links.from_measurement(seconds, ranks=2, between="nodes", backend="gloo")
    assert lk.crossing(64 << 10) == pytest.approx(0.6) and lk.crossing(1 << 20) == pytest.approx(0.4)
    assert lk.crossing(256 << 10) == pytest.approx(0.5)  # half way in log size
    assert lk.crossing(1024) == pytest.approx(0.6) and lk.crossing(8 << 20) == pytest.approx(0.4)
    assert links.from_record(lk.as_record()).crossing(64 << 10) == pytest.approx(0.6)
    assert lk.describe()["crossing"] == {str(64 << 10): 0.6, str(1 << 20): 0.4}
    # independent directions (the pair in its lag plus one send) give 0, and so does a link not measured so
    free = links.from_measurement({**seconds, CROSSED: {b: pair(b, 0.0) * 0.99 for b in seconds[CROSSED]}},
                                  ranks=2, between="nodes", backend="gloo")
    assert free.crossing(64 << 10) == 0.0
    assert links.from_measurement({"send_recv": seconds["send_recv"]}, ranks=2, between="nodes", backend="gloo").crossing(1e5) == 0.0
    # a pipeline of two on that link: its sends take the measured share where they overlap
    c = replace(_cpu(), links={"inter": lk})
    assert costs.crossing(64 << 10, costs.Group(2, 1), c) == pytest.approx(0.6)
    assert costs.crossing(64 << 10, costs.Group(1, 2), c) == 0.0  # inside a node: not measured there
    assert math.isclose(costs.crossing(64 << 10, costs.Group(2, 1), _cpu()), 0.0)
    pp2, s = Layout("pp=2", ParallelDims(pp=2)), Settings(batch=8, microbatches=4)
    p = predict(_prof(), c, pp2, s)
    f, b = p.phases_s["forward"] / 4, p.phases_s["backward"] / 4
    assert p.phases_s["p2p"] == pytest.approx(_span(f, b, costs.Group(2, 1), c, crossed=0.6) - 5 * (f + b))
    assert p.phases_s["p2p"] > predict(_prof(), replace(c, links={"inter": free}), pp2, s).phases_s["p2p"]


def test_a_connection_paced_below_the_link_slows_a_pipelines_hand_offs():
    """The probe's 64 KiB sends on a connection of their own took 21.5 ms on a 100 Mbit/s link
    with 10 ms each way, where the warmed connection's send of that size takes ~15.6 (the bed's
    BBR paced it at ~47 Mbit/s; benchmarks/p2p_window.py): a pipeline's hand-off pays that pace
    for its first 64 KiB, the rest at the link's rate, and gains no burst after idle."""
    from dtrain.diag.probe import IDLE, STREAM, one_way_at
    from dtrain.plan.pipeline_sim import makespan

    one = {64: 0.010, 1 << 20: 0.010 + (1 << 20) / 12.5e6, 4 << 20: 0.010 + (4 << 20) / 12.5e6}
    size = 64 << 10
    assert one_way_at(one, size) == pytest.approx(0.010 + size / 12.5e6, rel=1e-3)  # ~15.2 ms
    lk = links.from_measurement({"send_recv": one, STREAM: {size: 0.0215}, IDLE: {size: 0.0150}},
                                ranks=2, between="nodes", backend="gloo")
    rate = size / (0.0215 - 0.010)
    assert lk.paced() == (size, pytest.approx(rate))
    assert lk.describe()["paced_gbit_per_s"] == pytest.approx(round(rate * 8 / 1e9, 4))
    assert links.from_record(lk.as_record()).paced() == (size, pytest.approx(rate))
    # CUBIC on the same link: the stream no slower than the warmed send; or not measured: not paced
    for other in ({"send_recv": one, STREAM: {size: 0.0151}}, {"send_recv": one}):
        assert links.from_measurement(other, ranks=2, between="nodes", backend="gloo").paced() is None
    c = replace(_cpu(), links={"inter": lk})
    g = costs.Group(2, 1)
    p2p = lambda x: costs.p2p(x, g, c)  # noqa: E731
    assert costs.paced_p2p(200, g, c) == pytest.approx(p2p(1) + 200 / rate)
    assert costs.paced_p2p(1 << 20, g, c) == pytest.approx(p2p(1) + size / rate + p2p(1 << 20) - p2p(size))
    assert costs.paced_p2p(1 << 20, g, c) > p2p(1 << 20)
    assert costs.paced_p2p(200, costs.Group(1, 2), c) is None  # inside a node: not measured there
    # a pipeline of two on that link: each hand-off at the pace, no burst saved
    pp2, s = Layout("pp=2", ParallelDims(pp=2)), Settings(batch=8, microbatches=4)
    p = predict(_prof(), c, pp2, s)
    f, b = p.phases_s["forward"] / 4, p.phases_s["backward"] / 4
    paced = makespan(2, 4, f, b, p2p(1) + 200 / rate, latency=p2p(1))
    assert p.phases_s["p2p"] == pytest.approx(paced - 5 * (f + b))
    free = links.from_measurement({"send_recv": one, IDLE: {size: 0.0150}}, ranks=2, between="nodes", backend="gloo")
    assert p.phases_s["p2p"] > predict(_prof(), replace(c, links={"inter": free}), pp2, s).phases_s["p2p"]


def test_a_record_round_trips_and_bad_files_are_one_line(tmp_path):
    secs = {k: _times(k, 1e-4, 1e8, 2) for k in links.SHAPES}
    got = links.from_measurement(secs, ranks=2, between="nodes", backend="gloo", load=1.5)
    path = tmp_path / "links.json"
    path.write_text(json.dumps(got.as_record()))
    back = links.load(str(path))
    assert back.between == "nodes" and back.figures["send_recv"].bw == pytest.approx(1e8)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        links.load(str(path))
    path.write_text('{"between": "racks", "ranks": 2, "seconds": {}}')
    with pytest.raises(ConfigError, match="between 'processes' or 'nodes'"):
        links.load(str(path))
    with pytest.raises(ConfigError, match="cannot be read"):
        links.load(str(tmp_path / "missing.json"))


def test_measured_links_replace_the_described_ones_where_measured():
    c = cluster.build({"device": "cpu", "nodes": 2, "procs_per_node": 2, "inter_gbit": 1.0, "inter_latency_us": 100})
    secs = {"all_reduce": _times("all_reduce", 2e-3, 5e6, 2)}
    m = cluster.with_links(c, {"inter": links.from_measurement(secs, ranks=2, between="nodes", backend="gloo")})
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
    m = cluster.with_links(c, {"inter": links.from_measurement(secs, ranks=2, between="nodes", backend="gloo")})
    assert costs.gather(1e6, g, m, reduce=True) == pytest.approx(1e-3 + 0.5 * 1e6 / 2e6, rel=1e-3)


def test_broadcasts_pay_a_latency_per_message_and_gloo_a_tree():
    c = cluster.build({"device": "cpu", "nodes": 4, "procs_per_node": 1, "inter_gbit": 8e-3 * 8, "inter_latency_us": 1000})
    bw = c.inter_bw
    assert costs.broadcast(1e6, costs.Group(2, 1), c, messages=10) == pytest.approx(10 * 1e-3 + 1e6 / bw)
    assert costs.broadcast(1e6, costs.Group(4, 1), c) == pytest.approx(2 * (1e-3 + 1e6 / bw))  # two rounds of a binomial tree


def _span(f: float, b: float, group: costs.Group, c, **kw) -> float:
    """A pipeline of two, 4 micro-batches of 200 bytes, played out on ``group``'s link in ``c``."""
    from dtrain.plan.pipeline_sim import makespan

    return makespan(2, 4, f, b, costs.p2p(200, group, c), latency=costs.p2p(1, group, c), **kw)


def _machinery(**steps: tuple[float, float, float]) -> Machinery:
    base = {"plain": Phases(0.010, 0.020, 0.002)}
    base.update({k: Phases(*v) for k, v in steps.items()})
    return Machinery(batch=8, microbatches=4, steps=base, average_s=0.004, rounds=5,
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


def test_powersgd_compute_is_the_measured_one_and_local_sgd_pays_its_average_every_h_steps():
    m = _machinery(**{"ddp:powersgd:2": (0.010, 0.030, 0.002), "ddp:localsgd:8": (0.010, 0.020, 0.002)})
    c, s = _cpu(), Settings(batch=8)
    psgd = Layout("ddp", ParallelDims(dp_replicate=2), comm="powersgd:2")
    bare, measured = predict(_prof(), c, psgd, s), predict(_prof(m), c, psgd, s)
    flops = 4 * 500 * 500 * 2
    rate = 2.5e6 / (0.010 / 8)  # the profile's forward FLOP/s
    assert bare.phases_s["exposed_comm"] - measured.phases_s["exposed_comm"] == pytest.approx(flops / rate)
    assert measured.phases_s["backward"] - bare.phases_s["backward"] == pytest.approx(0.010)
    local = Layout("ddp", ParallelDims(dp_replicate=2), comm="localsgd:8")
    gap = predict(_prof(m), c, local, s).phases_s["exposed_comm"] - predict(_prof(), c, local, s).phases_s["exposed_comm"]
    assert gap == pytest.approx(0.004 / 8)


def test_a_pipeline_slot_is_a_measured_micro_batch_plus_the_schedules_own_work():
    # one micro-batch of 2: 4 + 6 ms; the one-stage schedule of 4 micro-batches took 48 ms: 2 ms each of its own
    m = replace(_machinery(micro=(0.004, 0.006, 0.0), pp=(0.048, 0.0, 0.002)))
    p = predict(_prof(m), _cpu(), Layout("pp=2", ParallelDims(pp=2)), Settings(batch=8, microbatches=4))
    share = (1e6 + 0.5e6 / 2) / 2.5e6  # the busiest stage: one block and half the rest's FLOPs
    assert p.phases_s["forward"] == pytest.approx(4 * (0.004 * share + 0.002))
    assert p.phases_s["backward"] == pytest.approx(4 * 0.006 * share)
    per_mb = (p.phases_s["forward"] + p.phases_s["backward"]) / 4
    assert p.phases_s["bubble"] == pytest.approx(per_mb)


def test_a_pipeline_of_two_measured_in_the_world_of_two_is_its_schedule_plus_what_the_link_adds():
    m = replace(_machinery(micro=(0.004, 0.006, 0.0), pp=(0.048, 0.0, 0.002)),
                steps2={"plain": Phases(0.012, 0.024, 0.002), "pp": Phases(0.060, 0.0, 0.002)})
    s, pp2 = Settings(batch=8, microbatches=4), Layout("pp=2", ParallelDims(pp=2))
    p = predict(_prof(m), _cpu(), pp2, s)
    # the two stages' schedule as measured (forward, backward and bubble scaled to it, in the model's proportions)
    assert p.phases_s["forward"] + p.phases_s["backward"] + p.phases_s["bubble"] == pytest.approx(0.060)
    assert p.phases_s["bubble"] == pytest.approx(0.060 / 5)  # (p - 1) of m + p - 1 slots
    assert p.phases_s["p2p"] < 1e-4  # 200 bytes a send on 1 Gbit/s, no latency: what loopback already had
    slow = replace(_cpu(), inter_lat=0.005)
    q = predict(_prof(m), slow, pp2, s)
    f, b = q.phases_s["forward"] / 4, q.phases_s["backward"] / 4
    local = _span(f, b, costs.Group(1, 2), slow)
    assert q.phases_s["p2p"] == pytest.approx(_span(f, b, costs.Group(2, 1), slow) - local)
    assert q.phases_s["p2p"] > 0.005  # at least one send's latency on the critical path
    # four processes on two shared cores: twice the world of one's time (an even share), over the
    # pair's own slowdown (its plain step, 38 ms with both ranks at once, against 32 ms alone)
    shared = replace(_cpu(4), shared_cores=2)
    r = predict(_prof(m), shared, Layout("pp=2,dp_replicate=2", ParallelDims(pp=2, dp_replicate=2)), s)
    assert r.phases_s["forward"] + r.phases_s["backward"] + r.phases_s["bubble"] == pytest.approx(0.060 * 2.0 / (0.038 / 0.032))
    # two processes on those cores: the pair's schedule as it is
    q2 = predict(_prof(m), replace(_cpu(2), shared_cores=2), pp2, s)
    assert q2.phases_s["forward"] + q2.phases_s["backward"] + q2.phases_s["bubble"] == pytest.approx(0.060)
    # where the pair does not apply, the world of one's slots (activation checkpointing, other micro-batching)
    base = predict(_prof(replace(m, steps2={})), _cpu(), pp2, replace(s, microbatches=2))
    assert predict(_prof(m), _cpu(), pp2, replace(s, microbatches=2)).phases_s == base.phases_s
    ac = replace(s, activation_checkpointing=True)
    assert predict(_prof(m), _cpu(), pp2, ac).phases_s == predict(_prof(replace(m, steps2={})), _cpu(), pp2, ac).phases_s


def test_a_pipeline_whose_processes_outnumber_the_shared_cores_takes_the_layouts_own_schedule_as_timed():
    m = replace(_machinery(micro=(0.004, 0.006, 0.0), pp=(0.048, 0.0, 0.002)),
                steps2={"plain": Phases(0.012, 0.024, 0.002), "pp": Phases(0.060, 0.0, 0.002)},
                schedules={"pp=2,dp_replicate=2": (4, 0.150)})
    s, lay = Settings(batch=8, microbatches=4), Layout("pp=2,dp_replicate=2", ParallelDims(pp=2, dp_replicate=2))
    shared = replace(_cpu(4), shared_cores=2, inter_lat=0.002)
    p = predict(_prof(m), shared, lay, s)
    # the 4 processes' schedule as the job ran it on these cores (not the pair's 60 ms x 2 / 1.19)
    f, b, bubble = p.phases_s["forward"], p.phases_s["backward"], p.phases_s["bubble"]
    assert f + b + bubble == pytest.approx(0.150)
    # the link pays what its sends add beyond the loopback the schedule was timed on
    assert p.phases_s["p2p"] == pytest.approx(_span(f / 4, b / 4, costs.Group(2, 1), shared) - _span(f / 4, b / 4, costs.Group(1, 2), shared))
    assert p.phases_s["p2p"] > 0.002
    # timed for another world, another micro-batching, or on cores the job does not outnumber: the pair's, scaled
    without = predict(_prof(replace(m, schedules={})), shared, lay, s).phases_s
    assert predict(_prof(replace(m, schedules={"pp=2,dp_replicate=2": (2, 0.150)})), shared, lay, s).phases_s == without
    assert predict(_prof(m), shared, lay, replace(s, microbatches=2)).phases_s == \
        predict(_prof(replace(m, schedules={})), shared, lay, replace(s, microbatches=2)).phases_s
    own = replace(shared, shared_cores=None)
    assert predict(_prof(m), own, lay, s).phases_s == predict(_prof(replace(m, schedules={})), own, lay, s).phases_s
    assert m.describe()["schedules_ms"] == {"pp=2,dp_replicate=2": {"processes": 4, "schedule": 150.0}}


def test_paired_tp_fsdp_and_zero_phases_hold_their_loopback_collectives_so_the_link_pays_only_the_rest():
    fig = links.Figure(lat=1e-4, bw=0.5e9)  # the world of two's loopback: 100 us a step, 4 Gbit/s
    loop = links.Links(between="processes", ranks=2, backend="gloo", figures=dict.fromkeys(links.SHAPES, fig))
    m = replace(_machinery(tp=(0.012, 0.022, 0.004), fsdp=(0.015, 0.030, 0.012), zero1=(0.010, 0.020, 0.004)),
                steps2={"plain": Phases(0.010, 0.020, 0.002), "tp": Phases(0.012, 0.022, 0.004),
                        "fsdp": Phases(0.015, 0.030, 0.012), "zero1": Phases(0.010, 0.020, 0.004)})
    s, c = Settings(batch=8), replace(_cpu(), inter_lat=1e-3)
    g2, inside = costs.Group(2, 1), costs.Group(1, 2)
    looped = replace(c, links={"intra": loop})
    prof, bare = _prof(replace(m, loopback=loop)), _prof(m)
    tp = Layout("tp=2", ParallelDims(tp=2))

    def tp_cost(cl, g):
        return 8 * 2 * costs.gather(8 * 100.0, g, cl) + 2 * costs.gather(8 * prof.out_bytes, g, cl)
    assert predict(bare, c, tp, s).phases_s["exposed_comm"] == pytest.approx(tp_cost(c, g2))
    assert predict(prof, c, tp, s).phases_s["exposed_comm"] == pytest.approx(tp_cost(c, g2) - tp_cost(looped, inside))
    z = Layout("zero1", ParallelDims(dp_replicate=2), zero1=True)
    assert predict(bare, c, z, s).phases_s["exposed_comm"] - predict(prof, c, z, s).phases_s["exposed_comm"] == \
        pytest.approx(costs.broadcast(4 * 250_000, inside, looped, messages=2))  # the broadcasts' loopback share (a latency per sender)
    f = Layout("fsdp", ParallelDims(dp_shard=2))
    assert predict(prof, c, f, s).phases_s["exposed_comm"] < predict(bare, c, f, s).phases_s["exposed_comm"]
    # a link faster than the loopback adds nothing (not a negative time)
    fast = replace(_cpu(), inter_bw=100e9)
    assert predict(prof, fast, tp, s).phases_s["exposed_comm"] == 0.0
    assert prof.machinery.describe()["loopback"]["figures"]["all_gather"]["gbit_per_s"] == 4.0


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
    pp = memory(replace(prof, machinery=replace(m, rss={**m.rss, "pipelining": 50 * MIB})), c, Layout("pp=2", ParallelDims(pp=2)), s)
    assert pp["baseline"] == 650 * MIB


def test_gpu_peak_is_the_allocators_without_the_context_and_holds_the_outputs_gradient():
    prof = replace(_prof(), out_bytes=1000.0, timing=None)
    c = cluster.build({"device": "h100", "nodes": 1, "procs_per_node": 2})
    p = predict(prof, c, Layout("ddp", ParallelDims(dp_replicate=2)), Settings(batch=8))
    assert p.memory["transient"] == 8000.0 and "baseline" not in p.memory
    assert p.peak_bytes == pytest.approx(p.mem_bytes - c.device.fixed_bytes)


def test_processes_sharing_cores_slow_down_by_their_share_beside_the_measured_other_load():
    c = cluster.build({"device": "cpu", "nodes": 4, "procs_per_node": 1, "shared_cores": 2})
    assert c.compute_slowdown(1) == pytest.approx(2.0)  # 4 processes on 2 cores; the profile had a core alone
    # 10 other runnable threads: the profile got 2/11 of a core, each of the 4 processes 2/14
    assert c.compute_slowdown(1, other=10.0) == pytest.approx(14 / 11)
    assert cluster.build({"device": "cpu", "nodes": 4, "procs_per_node": 1}).compute_slowdown(1, other=10.0) == 1.0
    m = replace(_machinery(), other_load=10.0)
    p = predict(_prof(m), replace(c, device=cluster.cpu_device(1e9)), Layout("ddp", ParallelDims(dp_replicate=4)), Settings(batch=8))
    assert p.phases_s["forward"] == pytest.approx(0.010 * 14 / 11)
    # Linux's autogroups share the cores between sessions, and each worker has its own: with 3 other
    # busy sessions the profile had 2/4 of the cores, each of the 4 workers 2/7
    assert c.compute_slowdown(1, other=3.0, by_session=True) == pytest.approx((2 / 4) / (2 / 7))
    assert c.compute_slowdown(1, other=0.0, by_session=True) == pytest.approx(2.0)


def test_more_processes_than_shared_cores_take_the_measured_corun_slowdown():
    c = cluster.build({"device": "cpu", "nodes": 4, "procs_per_node": 1, "shared_cores": 2})
    assert c.oversubscribed(1) and not replace(c, nodes=2).oversubscribed(1) and not replace(c, shared_cores=None).oversubscribed(1)
    assert c.compute_slowdown(1, measured=2.5) == 2.5
    assert c.compute_slowdown(1, measured=1.76) == 2.0  # 4 one-thread processes on 2 cores: half a core each at best
    assert replace(c, nodes=2).compute_slowdown(1, measured=0.9) == 0.9  # 2 on 2 cores: the pair's own figure, as measured
    assert replace(c, shared_cores=None).compute_slowdown(1, measured=2.5) == 1.0  # own cores: nothing shared
    m = replace(_machinery(), corun=(4, 0.010, 0.025))
    assert m.corun_slowdown(4) == pytest.approx(2.5) and m.corun_slowdown(2) is None
    assert m.describe()["corun"] == {"processes": 4, "alone_ms": 10.0, "together_ms": 25.0}
    p = predict(_prof(m), replace(c, device=cluster.cpu_device(1e9)), Layout("ddp", ParallelDims(dp_replicate=4)), Settings(batch=8))
    assert p.phases_s["forward"] == pytest.approx(0.010 * 2.5)  # not the formula's 2.0
    two = replace(c, nodes=2, device=cluster.cpu_device(1e9))  # measured for 4 processes: a job of 2 keeps the formula
    assert predict(_prof(m), two, Layout("ddp", ParallelDims(dp_replicate=2)), Settings(batch=8)).phases_s["forward"] == pytest.approx(0.010)
    # unless the world of two ran: its ranks' plain step at once (40 ms) over the world of one's (32 ms)
    paired = replace(m, steps2={"plain": Phases(0.0125, 0.025, 0.0025)})
    assert paired.corun_slowdown(2) == pytest.approx(1.25) and paired.corun_slowdown(4) == pytest.approx(2.5)
    assert predict(_prof(paired), two, Layout("ddp", ParallelDims(dp_replicate=2)), Settings(batch=8)).phases_s["forward"] == \
        pytest.approx(0.0125)


def test_kinds_measured_in_a_world_of_two_give_their_extra_over_that_worlds_plain_step():
    from dtrain.plan.machinery import paired_kinds
    from dtrain.plan.sharing import agree as _agree

    assert paired_kinds(["plain", "ddp:none", "ddp:bf16", "ddp:powersgd:2", "ddp:localsgd:16", "zero1", "fsdp", "tp", "pp", "micro"]) == \
        ["ddp:none", "ddp:bf16", "zero1", "fsdp", "tp", "pp"]
    assert _agree(True) is True and _agree(False) is False  # no process group: this process decides alone
    one = _machinery(**{"tp": (0.012, 0.022, 0.004), "fsdp": (0.015, 0.030, 0.012)})
    two = replace(one, steps2={"plain": Phases(0.012, 0.024, 0.004), "tp": Phases(0.030, 0.040, 0.020),
                               "fsdp": Phases(0.020, 0.030, 0.010)})
    # TP splits the work: its extra is over half of the paired plain step; FSDP's over the whole of it
    assert two.extra("tp") == Phases(pytest.approx(0.024), pytest.approx(0.028), pytest.approx(0.018))
    assert two.extra("fsdp") == Phases(pytest.approx(0.008), pytest.approx(0.006), pytest.approx(0.006))
    assert one.extra("tp") == Phases(pytest.approx(0.002), pytest.approx(0.002), pytest.approx(0.002))  # the world of one
    assert two.extra("ddp:none") == Phases(0.0, 0.0, 0.0)  # measured in neither
    assert "steps2_ms" in two.describe() and two.describe()["steps2_ms"]["tp"]["forward"] == 30.0


def test_an_extra_measured_in_the_world_of_two_is_not_slowed_again_by_the_sharing_it_was_measured_under():
    # the world of two: plain 40 ms with both ranks at once (32 ms alone: 1.25x), FSDP 10 ms more forward
    m = replace(_machinery(fsdp=(0.015, 0.020, 0.002)), steps2={"plain": Phases(0.0125, 0.025, 0.0025),
                                                                 "fsdp": Phases(0.0225, 0.025, 0.0025)})
    assert m.paired("fsdp") and not m.paired("tp")
    fsdp, s = Layout("fsdp", ParallelDims(dp_shard=2)), Settings(batch=8)
    two = replace(_cpu(2), shared_cores=2)  # two processes: the pair's own sharing, 1.25x
    assert predict(_prof(m), two, fsdp, s).phases_s["forward"] == pytest.approx(0.010 * 1.25 + 0.010)
    four = replace(_cpu(4), shared_cores=2)  # four on two cores (2x), over the pair's 1.25x
    assert predict(_prof(m), four, Layout("fsdp", ParallelDims(dp_shard=4)), s).phases_s["forward"] == \
        pytest.approx(0.010 * 2.0 + 0.010 * 2.0 / 1.25)
    # measured in the world of one only: the whole slowdown
    one = replace(m, steps2={"plain": Phases(0.0125, 0.025, 0.0025)})
    assert predict(_prof(one), two, fsdp, s).phases_s["forward"] == pytest.approx((0.010 + 0.005) * 1.25)


def test_a_paired_ddp_step_times_backward_to_the_graphs_end_not_the_wait_after_it():
    import time

    import torch

    from dtrain.plan.timing import timed_step

    class Slow(torch.autograd.Function):  # a wait that runs after the graph, as DDP's last all-reduce does
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: time.sleep(0.05))
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            return Slow.apply(self.lin(x))

    task = type("T", (), {"loss_fn": staticmethod(lambda out, y: ((out - y) ** 2).mean())})
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    whole = timed_step(net, opt, task, x, y, lambda: torch.autocast("cpu", enabled=False))()
    to_end = timed_step(net, opt, task, x, y, lambda: torch.autocast("cpu", enabled=False), compute_end=True)()
    assert whole[1] >= 0.05 and to_end[1] < 0.05 and to_end[2] < 0.05


def _bursting_link(burst: float, rate: float = 2.5e6, lat: float = 4e-4) -> links.Links:
    """A 20 Mbit/s link (every collective at ``lat`` per step) whose shaper lets ``burst`` bytes
    through at once after idle time: the probe's send after idle moves only the rest at the rate."""
    from dtrain.diag.probe import IDLE, IDLE_SIZE

    sizes = (64, 1 << 20, 4 << 20)
    seconds = {kind: _times(kind, lat, rate, 2, sizes) for kind in links.SHAPES}
    seconds[IDLE] = {IDLE_SIZE: lat + max(0.0, IDLE_SIZE - burst) / rate}
    return links.from_measurement(seconds, ranks=2, between="nodes", backend="gloo")


def test_a_links_burst_after_idle_is_read_off_the_send_after_an_idle_pause():
    from dtrain.diag.probe import IDLE, IDLE_SIZE

    lk = _bursting_link(16 << 10)
    # send_recv read at 64 KiB (linear from 64 B to 1 MiB) against the send after idle
    assert lk.burst() == pytest.approx(16 << 10, rel=0.01)
    assert links.from_record(lk.as_record()).burst() == pytest.approx(lk.burst())
    assert lk.describe()["burst_bytes"] == round(lk.burst())
    assert _bursting_link(0).burst() == pytest.approx(0, abs=1e-6 * IDLE_SIZE)
    # within 0 and the size sent: a send after idle slower than one after a barrier, or one that took its latency only
    slow = links.from_measurement({**lk.seconds, IDLE: {IDLE_SIZE: 1.0}}, ranks=2, between="nodes", backend="gloo")
    assert slow.burst() == 0.0
    free = links.from_measurement({**lk.seconds, IDLE: {IDLE_SIZE: 1e-4}}, ranks=2, between="nodes", backend="gloo")
    assert free.burst() == IDLE_SIZE
    # not measured (a record from before the probe sent after idle): none
    assert links.from_measurement({"send_recv": lk.seconds["send_recv"]}, ranks=2, between="nodes", backend="gloo").burst() == 0.0


def test_powersgd_and_local_sgd_send_their_first_burst_of_bytes_at_once():
    """Their all-reduces follow compute, the link idle: what a burst saves comes off their
    communication (the latency stays); so does DDP's one bucket, ready as backward ends."""
    c0, c16 = (replace(_cpu(), links={"inter": _bursting_link(b)}) for b in (0, 16 << 10))
    g = costs.Group(2, 1)
    for nbytes in (10_000, 30_000, 1 << 20):
        saved = costs.allreduce(nbytes, g, c16) - costs.allreduce_after_idle(nbytes, g, c16)
        assert saved == pytest.approx(min(nbytes - 4, 16 << 10) / 2.5e6, rel=0.02)
        assert costs.allreduce_after_idle(nbytes, g, c0) == pytest.approx(costs.allreduce(nbytes, g, c0))
    assert costs.allreduce_after_idle(10_000, g, c16) == pytest.approx(costs.allreduce(4, g, c16))  # latency only
    assert costs.allreduce_after_idle(10_000, costs.Group(1, 2), c16) == costs.allreduce(10_000, costs.Group(1, 2), c16)
    s = Settings(batch=8)
    psgd, local, plain = (Layout("ddp", ParallelDims(dp_replicate=2), comm=k) for k in ("powersgd:2", "localsgd:8", "none"))
    comm = {(k, b): predict(_prof(), c, lay, s).phases_s["exposed_comm"]
            for k, lay in (("psgd", psgd), ("local", local), ("none", plain)) for b, c in ((0, c0), (16, c16))}
    sent = (2 * 500 * 2 + 250_000 - 500 * 500) * 4  # P and Q of the 500 x 500 matrix, the rest whole
    assert comm["psgd", 0] - comm["psgd", 16] == pytest.approx(min(sent - 4, 16 << 10) / 2.5e6, rel=0.02)
    assert comm["local", 0] - comm["local", 16] == pytest.approx((16 << 10) / 2.5e6 / 8, rel=0.02)
    assert comm["none", 0] - comm["none", 16] == pytest.approx((16 << 10) / 2.5e6, rel=0.02)


def test_fsdp_and_pipeline_transfers_that_find_the_link_idle_send_a_burst_at_once():
    """FSDP's gathers and scatters and a pipeline's sends between compute: each that finds its
    link idle long enough takes the burst's time less (``costs.idle_saving``); fewer than all do."""
    c0, c16 = (replace(_cpu(), links={"inter": _bursting_link(b)}) for b in (0, 16 << 10))
    burst_s = (16 << 10) / 2.5e6
    s = Settings(batch=8)
    fsdp = Layout("fsdp", ParallelDims(dp_shard=2))
    saved = predict(_prof(), c0, fsdp, s).step_s - predict(_prof(), c16, fsdp, s).step_s
    # 2 units: 2 gathers in forward, 2 gathers and 2 scatters in backward; not every one finds the link idle
    assert 0 < saved < 6 * burst_s
    # the saving of one gather is the burst's bytes at the link's rate (each rank sends half the result)
    g = costs.Group(2, 1)
    gather = lambda x: costs.gather(x, g, c16)  # noqa: E731
    assert costs.idle_saving(gather, "all_gather", 1 << 20, g, c16) == pytest.approx(burst_s, rel=0.02)
    assert costs.idle_saving(gather, "all_gather", 1 << 20, g, c0) == 0.0
    pp = Layout("pp=2", ParallelDims(pp=2))
    p0, p16 = (predict(_prof(), c, pp, Settings(batch=8, microbatches=4)) for c in (c0, c16))
    assert 0 < p0.phases_s["p2p"] - p16.phases_s["p2p"] <= 8 * burst_s + 1e-9


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
    assert predict(_prof(), _cpu(1).with_world(1, 1), Layout("single", ParallelDims()), Settings(batch=8)).phases_s["log"] == 0.0


def test_local_sgd_on_shared_cores_waits_for_the_slower_rank_by_the_measured_drift():
    """Stretches of steps without a meeting: the slower rank's time over the ranks' mean (summed
    over stretches) times the step's compute, for a job of two on the profile's shared cores only."""
    from dtrain.plan.machinery import drift_steps

    stretches = [(0.110, 0.100), (0.105, 0.100), (0.100, 0.100)]  # 315 / 300: x1.05
    m = replace(_machinery(), drift=(10, stretches))
    assert m.drift_factor() == pytest.approx(1.05)
    assert replace(m, drift=(10, [(0.1, 0.1)])).drift_factor() == 1.0 and _machinery().drift_factor() is None
    s = Settings(batch=8)
    local = Layout("ddp", ParallelDims(dp_replicate=2), comm="localsgd:8")
    shared = replace(_cpu(2), shared_cores=2)
    with_drift, without = predict(_prof(m), shared, local, s), predict(_prof(_machinery()), shared, local, s)
    compute = sum(with_drift.phases_s[k] for k in ("data", "forward", "backward", "optimizer"))
    assert with_drift.phases_s["drift"] == pytest.approx(0.05 * compute) and "drift" not in without.phases_s
    assert with_drift.step_s - without.step_s == pytest.approx(0.05 * compute)
    assert "x1.050 of the compute" in " ".join(with_drift.notes)
    assert "drift" not in predict(_prof(m), _cpu(2), local, s).phases_s  # ranks on cores of their own
    assert "drift" not in predict(_prof(m), replace(_cpu(4), shared_cores=2), local, s).phases_s  # four: not measured
    assert "drift" not in predict(_prof(m), shared, Layout("ddp", ParallelDims(dp_replicate=2), comm="powersgd:2"), s).phases_s
    # what is measured: the longest period, cut at the log steps (they meet too); only where it is used
    layouts = [local, Layout("ddp", ParallelDims(dp_replicate=2), comm="localsgd:32")]
    assert drift_steps(layouts, shared, log_every=20) == 20 and drift_steps(layouts, shared, log_every=50) == 32
    assert drift_steps(layouts, _cpu(2)) is None and drift_steps(layouts[:0], shared) is None
    assert drift_steps(layouts, replace(_cpu(4), shared_cores=2)) is None
