"""`dtrain plan`'s model, pure logic: the collective formulas, groups, overlap, memory and the
layouts' names, each against a hand calculation."""

from __future__ import annotations

import math

import pytest

from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims, parse
from dtrain.plan import Settings, cluster, costs, make_plan, predict
from dtrain.plan.layouts import Layout, candidates
from dtrain.plan.model import memory
from dtrain.plan.profile import Block, ModelProfile, transformer
from dtrain.plan.steps import ddp_sync, pipelined, powersgd_elements, stage_share

GB = 1e9


def flat(nodes=1, ppn=2, *, intra_bw=10 * GB, inter_bw=1 * GB, lat=1e-3, tree=False, device="h100"):
    c = cluster.build({"device": device, "nodes": nodes, "procs_per_node": ppn})
    from dataclasses import replace

    return replace(c, intra_bw=intra_bw, inter_bw=inter_bw, intra_lat=lat, inter_lat=lat, tree=tree)


def toy(params=1_000_000, blocks=4) -> ModelProfile:
    per = params // (blocks + 1)
    bl = tuple(Block(params=per, fwd_flops=1e6, act_bytes=1000.0, out_bytes=100.0) for _ in range(blocks))
    return ModelProfile(name="toy", params=params, fwd_flops=5e6, act_bytes=5000.0, blocks=bl, matrices=((1000, 1000),))


def test_ring_allreduce_matches_the_textbook_formula():
    # 2(n-1)/n x B / bw + 2(n-1) x latency: 4 ranks on one node, 100 MB at 10 GB/s, 1 ms
    c = flat(ppn=4, lat=1e-3)
    assert costs.allreduce(100e6, costs.Group(1, 4), c) == pytest.approx(1.5 * 0.01 + 6e-3)
    assert costs.gather(100e6, costs.Group(1, 4), c) == pytest.approx(0.75 * 0.01 + 3e-3)  # (n-1)/n x B / bw + (n-1) x lat
    assert costs.allreduce(100e6, costs.Group(1, 1), c) == 0.0
    assert costs.tree_allreduce(8, 1024, 10 * GB, 1e-3) == pytest.approx(20e-3, rel=1e-6)


def test_tree_is_used_only_where_the_cluster_has_one_and_it_is_cheaper():
    small = 8.0
    ring = flat(nodes=1, ppn=8, tree=False)
    tree = flat(nodes=1, ppn=8, tree=True)
    g = costs.Group(1, 8)
    assert costs.allreduce(small, g, ring) == pytest.approx(14e-3, rel=1e-3)  # latency-bound ring: 2 x 7 steps
    assert costs.allreduce(small, g, tree) == pytest.approx(6e-3, rel=1e-3)  # 2 x log2(8)
    big = 1e9  # bandwidth-bound: the ring's 2(n-1)/n < the tree's 2
    assert costs.allreduce(big, g, tree) == costs.allreduce(big, g, ring)


def test_hierarchical_allreduce_adds_intra_node_phases_to_the_nodes_ring():
    c = flat(nodes=4, ppn=8)
    g = costs.group_of(32, 1, 8)
    assert g == costs.Group(4, 8, 1)
    b = 80e6
    inter = 2 * 3 / 4 * b / c.inter_bw + 6 * c.inter_lat
    intra = 2 * (7 / 8 * b / c.intra_bw + 7 * c.intra_lat)
    assert costs.allreduce(b, g, c) == pytest.approx(inter + intra)


def test_groups_of_a_mesh_dimension_share_the_nodes_links():
    # 2 nodes x 4: tp=2 fastest, then dp_replicate=4 with stride 2: 2 per node, 2 such groups per node
    assert costs.group_of(4, 2, 4) == costs.Group(2, 2, 2)
    assert costs.group_of(2, 1, 4) == costs.Group(1, 2, 1)  # tp inside a node
    assert costs.group_of(2, 4, 4) == costs.Group(2, 1, 4)  # hsdp's replicas: one per node, 4 groups share a NIC
    c = flat(nodes=2, ppn=4, lat=0.0)
    one = costs.allreduce(1e9, costs.Group(2, 1, 1), c)
    assert costs.allreduce(1e9, costs.Group(2, 1, 4), c) == pytest.approx(4 * one)


def test_ddp_buckets_overlap_backward_except_what_ends_after_it():
    c = flat(nodes=1, ppn=2, intra_bw=1 * GB, lat=0.0)
    g = costs.Group(1, 2)
    # one bucket (25 MiB cap, 10 MB of gradients): nothing overlaps, 10 MB x 2(1)/2 / 1 GB/s = 10 ms
    wire, exposed = ddp_sync(10e6, 1.0, 0.050, g, c, 25 * 2**20)
    assert wire == pytest.approx(0.010) and exposed == pytest.approx(0.010)
    # four 10 MB buckets in a 100 ms backward: ready at 25, 50, 75, 100 ms; each 10 ms: only the last shows
    wire, exposed = ddp_sync(40e6, 1.0, 0.100, g, c, 10e6)
    assert wire == pytest.approx(0.040) and exposed == pytest.approx(0.010)
    # half the bytes (bf16)
    assert ddp_sync(10e6, 0.5, 0.050, g, c, 25 * 2**20)[1] == pytest.approx(0.005)


def test_pipelined_gathers_hide_behind_compute_when_issued_ahead():
    # three units: gather 1, compute 2, no scatter; ahead: 1 + 2 + 2 + 2 = 7; not ahead: 1 + 3 x (2) + 2 x 1 = 9
    items = [(1.0, 2.0, 0.0)] * 3
    assert pipelined(items, True)[0] == pytest.approx(7.0)
    assert pipelined(items, False)[0] == pytest.approx(9.0)
    # scatter after each compute on the same link: g0(1) c0 1..3, g1 issued at 1 -> 2, s0 3..4, c1 3..5, g2 at 4 -> 5, s1 5..6, c2 5..7, s2 7..8
    assert pipelined([(1.0, 2.0, 1.0)] * 3, True) == pytest.approx((8.0, 6.0))


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    prof = ModelProfile(name="even", params=400, fwd_flops=4e6, act_bytes=400.0,
                        blocks=tuple(Block(params=100, fwd_flops=1e6, act_bytes=100.0, out_bytes=0.0) for _ in range(4)))
    c = flat(nodes=1, ppn=2, lat=0.0)
    s = Settings(batch=8, microbatches=4)
    p = predict(prof, c, Layout("pp=2", ParallelDims(pp=2)), s)
    compute = p.phases_s["forward"] + p.phases_s["backward"]
    assert p.phases_s["bubble"] == pytest.approx(compute * (2 - 1) / 4)
    assert p.phases_s["bubble"] / (compute + p.phases_s["bubble"]) == pytest.approx(1 / 5)
    assert stage_share(prof, 2) == (0.5, 0.5, 0.5)


def test_a_pipeline_stage_holds_the_layers_outside_the_blocks_at_its_own_end():
    """dtrain cuts between blocks (parallel.pipeline.block_bounds): the embedding on the first stage, the
    head on the last. GPT-2's head (768 x 50257, 79 GFLOP a sample) is worth 4 of its 12 blocks."""
    gpt2 = transformer("GPT-2", layers=12, width=768, ffn=3072, heads=12, kv_heads=12, vocab=50257, seq=1024, tied=True, gated=False)
    block, head = gpt2.blocks[0].fwd_flops, 2 * 50257 * 768 * 1024
    assert gpt2.fwd_flops == pytest.approx(12 * block + head)
    f, p, a = stage_share(gpt2, 2)
    assert f == pytest.approx((6 * block + head) / gpt2.fwd_flops)  # the last stage: 6 blocks and the head (was half of it)
    assert p == pytest.approx((6 * gpt2.blocks[0].params + 50257 * 768) / gpt2.params)  # the first: 6 blocks and the embedding
    assert a == pytest.approx((6 * gpt2.blocks[0].act_bytes + 4 * 50257 * 1024) / gpt2.act_bytes)  # the last: the logits
    # counted from a task: the layers before the first block are found (the LM's token and position embeddings)
    from dtrain.plan.profile import profile_task
    from dtrain.tasks import load_task

    lm = profile_task(load_task("lm", options={"layers": "2", "width": "64", "heads": "2", "context": "64",
                                                "max_bytes": "200000", "tie": "false"}), batch=4)
    assert lm.before_blocks is not None and lm.before_blocks.params == (256 + 64) * 64 and lm.before_blocks.fwd_flops == 0
    head_flops = lm.fwd_flops - sum(b.fwd_flops for b in lm.blocks)
    assert stage_share(lm, 2)[0] == pytest.approx((lm.blocks[1].fwd_flops + head_flops) / lm.fwd_flops)


def test_memory_per_rank_by_layout():
    prof = toy(params=1_000_000, blocks=4)
    c = flat(nodes=1, ppn=4)
    s = Settings(batch=10, optimizer="adam")
    ddp = memory(prof, c, Layout("ddp", ParallelDims(dp_replicate=4)), s)
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4e6, 4e6, 8e6)
    assert ddp["activations"] == pytest.approx(5000.0 * 10)
    z1 = memory(prof, c, Layout("zero1", ParallelDims(dp_replicate=4), zero1=True), s)
    assert (z1["params"], z1["optimizer"]) == (4e6, 2e6)
    fsdp = memory(prof, c, Layout("fsdp", ParallelDims(dp_shard=4)), s)
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == (1e6, 1e6, 2e6)
    assert fsdp["gathered"] == 2 * 4 * 200_000  # two units whole, fp32
    tp = memory(prof, c, Layout("tp=2", ParallelDims(tp=2)), s)
    assert tp["params"] == 2e6 and tp["activations"] == pytest.approx(25000.0)
    ac = memory(prof, c, Layout("ddp", ParallelDims(dp_replicate=4)), Settings(batch=10, optimizer="adam", activation_checkpointing=True))
    # blocks keep their outputs (4 x 100) and one block's activations (1000); the rest (1000) as before
    assert ac["activations"] == pytest.approx((1000 + 400 + 1000) * 10)


def test_powersgd_sends_rank_times_rows_plus_columns():
    prof = toy()
    assert powersgd_elements(prof, 2) == pytest.approx(2 * 2000 + (1_000_000 - 1_000_000))
    small = ModelProfile(name="s", params=12, fwd_flops=1.0, act_bytes=0.0, matrices=((3, 4),))
    assert powersgd_elements(small, 2) == 12  # 2 x 7 = 14 would not halve 12: sent whole


def test_every_candidate_is_a_layout_dtrain_train_accepts():
    from dtrain.strategies import available

    names = set(available())
    for lay in candidates(16, 8, 2, blocks=4, tp_ok=True, pp_ok=True):
        if lay.is_strategy:
            assert lay.name in names
        else:
            dims = parse(lay.name)
            assert str(dims) == lay.name and dims.world_size == 16
    assert [x.name for x in candidates(1, 1, 1, blocks=0, tp_ok=False, pp_ok=False)] == ["single"]
    assert Layout("dp_shard=4,tp=2", ParallelDims(dp_shard=4, tp=2)).train_args() == ["--parallel", "dp_shard=4,tp=2"]
    assert Layout("ddp", ParallelDims(dp_replicate=2), comm="bf16").train_args() == ["--strategy", "ddp", "--comm", "bf16"]


def test_plan_ranks_fitting_layouts_first_and_json_has_the_issue_fields():
    prof = transformer("llama-ish", layers=8, width=1024, ffn=4096, heads=8, kv_heads=8, vocab=32000, seq=1024)
    c = cluster.build({"device": "h100", "nodes": 2, "procs_per_node": 8, "memory_gib": 4})
    plan = make_plan(prof, c, Settings(batch=4, precision="bf16-mixed", optimizer="adamw"))
    d = plan.as_dict()
    assert set(d) >= {"layouts", "best", "assumptions", "cluster", "model"}
    fits = [r["fits"] for r in d["layouts"]]
    assert fits == sorted(fits, reverse=True)
    for r in d["layouts"]:
        assert {"layout", "comm", "step_ms", "samples_per_s", "mem_mib_per_rank", "fits"} <= set(r)
    assert 0 < sum(fits) < len(fits)  # 4 GiB: some layouts fit, some do not
    assert d["best"] == d["layouts"][0] and d["best"]["fits"]  # the fastest of those that fit
    rates = [r["samples_per_s"] for r in d["layouts"] if r["fits"]]
    assert rates == sorted(rates, reverse=True)


def test_transformer_flops_follow_6n_plus_attention():
    prof = transformer("t", layers=2, width=64, ffn=256, heads=4, kv_heads=4, vocab=100, seq=16, gated=False)
    per_layer = 4 * 64 * 64 + 2 * 64 * 256
    assert prof.fwd_flops == pytest.approx(2 * (2 * per_layer + 4 * 16 * 64) * 16 + 2 * 100 * 64 * 16)
    assert math.isclose(prof.fwd_flops * 3 / 16, 6 * (2 * per_layer + 100 * 64) + 12 * 2 * 64 * 16, rel_tol=1e-9)


def test_cluster_inputs_are_checked():
    with pytest.raises(ConfigError, match="unknown --device"):
        cluster.device_named("h1000")
    with pytest.raises(ConfigError, match="fraction"):
        cluster.build({"device": "h100", "achieved_fraction": 1.5})
    c = cluster.build({"device": "a100", "nodes": 2, "procs_per_node": 8, "inter_gbit": 800})
    assert c.world_size == 16 and c.inter_bw == pytest.approx(100 * GB) and c.device.memory_bytes == 80e9


def test_cluster_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"device": "h100", "nodes": 4, "procs_per_node": 8, "inter_latency_us": 20}')
    c = cluster.build(cluster.load_file(str(f)))
    assert (c.nodes, c.procs_per_node, c.inter_lat) == (4, 8, pytest.approx(20e-6))
    f.write_text('{"gpus": 8}')
    with pytest.raises(ConfigError, match="unknown key"):
        cluster.load_file(str(f))


def test_best_exact_skips_methods_that_change_the_update():
    prof = toy(params=5_000_000)
    c = flat(nodes=2, ppn=1, inter_bw=1e6, lat=1e-3)  # 8 Mbit/s: compression and local SGD win on speed
    plan = make_plan(prof, c, Settings(batch=8), pp_ok=False)  # (pp=2 would send activations, not gradients)
    assert plan.best.layout.comm != "none"
    assert plan.best_exact.layout.comm == "none" and plan.best_exact.fits
    assert plan.as_dict()["best_exact"]["comm"] == "none"


def test_pipeline_transfers_follow_torchs_1f1b_waits():
    # 2 stages, 4 micro-batches, forward 7 and backward 13 per micro-batch, 28 per transfer. By hand
    # (a send completes when its bytes have crossed; 1F1B waits for each send with the next receive):
    # stage 0: F0 0-7, F1 7-14, waits its act0 send (35); act1 crosses 35-63, grad0 55-83; B0 83-96,
    # F2 96-103; act2 and grad1 cross 103-131; B1 131-144, F3 144-151; act3 and grad2 151-179;
    # B2 179-192; stage 1: F3 179-186, B3 186-199, grad3 crosses 199-227; stage 0's B3 227-240.
    from dtrain.plan.steps import makespan

    assert makespan(2, 4, 7.0, 13.0, 28.0, "1f1b") == pytest.approx(240.0)
    assert makespan(4, 8, 1.0, 2.0, 0.0, "1f1b") == makespan(4, 8, 1.0, 2.0, 0.0, "gpipe") == pytest.approx(11 * 3.0)
    # 2 micro-batches of no compute, 1 per transfer: act0 0-1, act1 1-2, grad0 1-2, grad1 2-3
    assert makespan(2, 2, 0.0, 0.0, 1.0) == pytest.approx(3.0)
    # A send moves no data before its receive is posted (torch posts it where it waits) and the
    # notice has crossed: GPipe, 2 stages, 2 micro-batches, F = B = 1, each transfer 3 of which 2
    # are latency (1 on the wire). act0: fired 1, posted 0 (+2 notice) -> wire 2-3, arrives 5; stage
    # 1's F0 5-6 posts act1 at 6 -> wire 8-9, arrives 11; F1 11-12, B0 12-13 fires grad0 (stage 0
    # posted it at 11: wire 13-14, arrives 16), B1 13-14 fires grad1; stage 0's B0 16-17 posts grad1
    # at 17 -> wire 19-20, arrives 22; B1 22-23. Without the latency, a receive posted late still
    # holds its send back: 18 (16 where every send went at once).
    assert makespan(2, 2, 1.0, 1.0, 3.0, "gpipe", latency=2.0) == pytest.approx(23.0)
    assert makespan(2, 2, 1.0, 1.0, 3.0, "gpipe") == pytest.approx(18.0)
    blocks = tuple(Block(params=100, fwd_flops=1e6, act_bytes=100.0, out_bytes=1e6) for _ in range(2))
    prof = ModelProfile(name="p", params=200, fwd_flops=2e6, act_bytes=200.0, blocks=blocks)
    c = flat(nodes=2, ppn=1, inter_bw=1e9, lat=0.0, device="cpu")
    p = predict(prof, c, Layout("pp=2", ParallelDims(pp=2)), Settings(batch=8, microbatches=4))
    hop = 2 * 1e6 / 1e9  # 2 samples per micro-batch x 1 MB at 1 GB/s
    fwd, bwd = p.phases_s["forward"] / 4, p.phases_s["backward"] / 4
    span = makespan(2, 4, fwd, bwd, hop)
    assert p.phases_s["bubble"] == pytest.approx(fwd + bwd)
    assert p.phases_s["p2p"] == pytest.approx(span - 5 * (fwd + bwd))


def test_gloo_reduce_scatter_costs_an_allreduce_and_zero1_pays_a_latency_per_sending_rank():
    g = costs.Group(1, 2)
    gpu, cpu = flat(ppn=2, lat=0.0), flat(ppn=2, lat=0.0, device="cpu")
    # nccl: a reduce-scatter, (n-1)/n x 1 MB at 10 GB/s; gloo has none and all-reduces: 2(n-1)/n x 1 MB at 10 GB/s
    assert costs.gather(1e6, g, gpu, reduce=True) == pytest.approx(0.5 * 1e6 / (10 * GB))
    assert costs.gather(1e6, g, cpu, reduce=True) == pytest.approx(1e6 / (10 * GB))
    prof = replace_tensors(toy(), 50)
    c = flat(ppn=2, lat=1e-3, device="cpu")
    z = predict(prof, c, Layout("zero1", ParallelDims(dp_replicate=2), zero1=True), Settings(batch=1))
    d = predict(prof, c, Layout("ddp", ParallelDims(dp_replicate=2)), Settings(batch=1))
    extra = z.phases_s["exposed_comm"] - d.phases_s["exposed_comm"]
    # broadcasts in turn: all bytes; queued before any is waited for: a latency per sending rank, not per tensor
    assert extra == pytest.approx(4e6 / c.intra_bw + 2 * 1e-3)


def replace_tensors(prof: ModelProfile, n: int) -> ModelProfile:
    from dataclasses import replace

    return replace(prof, tensors=n)
