"""The bed's own link model (benchmarks/plan_bed.py): its shaper's per-size rates, which the plan in
src/dtrain no longer models (no reference cluster's prediction moved by 5%: plan_terms.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.plan import costs

# Benchmark tooling, tested with the benchmarks (python3 -m pytest benchmarks/tests), not in the product's suite.
_PATH = Path(__file__).resolve().parents[1] / "plan_bed.py"
_spec = importlib.util.spec_from_file_location("plan_bed", _PATH)
bed = sys.modules.setdefault("plan_bed", importlib.util.module_from_spec(_spec))  # its dataclass looks itself up
_spec.loader.exec_module(bed)

MIB = 1 << 20
# 20 Mbit/s through tbf (the bed's lm-20m, run 8): 1 MiB at 18.5 Mbit/s, 4 MiB at 15 Mbit/s (TCP loses more to
# the shaper's drops on a long transfer); one line from the two largest sizes' difference put 548 KB at 314 ms
# where DDP's all-reduce of it took 231 ms
SECONDS = {64: 0.00466, MIB: 0.457, 4 * MIB: 2.230}


def test_a_link_whose_rate_depends_on_the_size_is_taken_at_each_measured_size():
    f = bed.sized_fit("all_reduce", SECONDS, 2)
    for b, t in SECONDS.items():  # every measured size as measured (the smallest's 64 bytes count twice: within 1%)
        assert f.seconds("all_reduce", b, 2) == pytest.approx(t, rel=1e-2 if b == 64 else 1e-6)
    assert 0.23 < f.seconds("all_reduce", 548_000, 2) < 0.25
    assert costs.fit("all_reduce", SECONDS, 2).seconds("all_reduce", 548_000, 2) > 0.3  # the plan's one rate
    mid = f.seconds("all_reduce", 2.5 * MIB, 2)  # between the sizes: their rates interpolated
    assert SECONDS[MIB] < mid < SECONDS[4 * MIB]
    # beyond the largest size: its time, then the marginal rate for the bytes beyond
    assert f.seconds("all_reduce", 8 * MIB, 2) == pytest.approx(2.230 + 4 * MIB / f.bw, rel=1e-6)
    # on 4 ranks: 3x the latency steps, 1.5x the volume; and two groups sharing the NICs: half the rate
    assert f.seconds("all_reduce", MIB, 4) == pytest.approx(6 * f.lat + 1.5 * (0.457 - 0.00466), rel=1e-6)
    assert f.shared(2).seconds("all_reduce", MIB, 2) == pytest.approx(0.00466 + 2 * (0.457 - 0.00466), rel=1e-6)
    assert bed.transfer(costs.Figure(1e-3, 1e6), 5e5) == pytest.approx(0.5)  # a plain figure: its bandwidth


def test_below_the_smallest_measured_size_the_shapers_burst_passes_at_once():
    """tbf's bucket refills while the link idles: PowerSGD's three small all-reduces after backward
    crossed the bed at once (benchmarks/plan_powersgd_bed.py); the 1 MiB rate alone over-predicted them."""
    f = bed.sized_fit("all_reduce", SECONDS, 2)
    assert f.burst == 16 * 1024  # NetBed's tbf at 20 Mbit/s: at least 16 KiB
    assert f.seconds("all_reduce", 16 * 1024, 2) == pytest.approx(SECONDS[64], rel=1e-2)  # the latency alone
    at_rate = SECONDS[64] + 31_700 / MIB * (SECONDS[MIB] - SECONDS[64])
    assert f.seconds("all_reduce", 31_700, 2) < 0.7 * at_rate  # 11.4 ms where one rate from 1 MiB says 18.3
    assert f.shared(2).burst == 8 * 1024


def test_plan_bed_runs_dtrain_plan_with_the_links_read_size_by_size(tmp_path):
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"between": "nodes", "ranks": 2, "backend": "gloo",
                                 "seconds": {"all_reduce": {str(b): t for b, t in SECONDS.items()}}}))
    args = ["plan", "--task", "digits", "--device", "a100", "-n", "1", "--nnodes", "2", "--links", str(links),
            "--json", "--layouts", "ddp", "--comm-methods", "none"]

    def exposed(cmd: list[str]) -> float:
        out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)["layouts"][0]["phases_ms"]["exposed_comm"]

    on_bed, plan = exposed([sys.executable, str(_PATH)]), exposed([sys.executable, "-m", "dtrain"])
    grads = 4 * 26_122  # digits' MLP: one bucket, exposed whole after a backward of microseconds
    assert on_bed == pytest.approx(1e3 * bed.sized_fit("all_reduce", SECONDS, 2).seconds("all_reduce", grads, 2), rel=0.05)
    assert plan == pytest.approx(1e3 * costs.fit("all_reduce", SECONDS, 2).seconds("all_reduce", grads, 2), rel=0.05)


def test_on_the_bed_a_pipelines_crossing_hand_offs_take_turns():
    """The bed's tbf queues each host's acknowledgements behind its data: an activation fired with a
    gradient going the other way arrived after both (benchmarks/pp_step_parts.py: 21.3 ms alone, 42.4
    crossing); the plan gives each direction its own link, as a NIC at line rate does."""
    from dtrain.plan import steps

    assert bed.bed_makespan(2, 1, 1.0, 1.0, 3.0) == steps.makespan(2, 1, 1.0, 1.0, 3.0)  # one micro-batch: nothing crosses
    # 1F1B, 2 stages, 4 micro-batches of 1 + 1 s, hand-offs of 10 s: after act 0, act i+1 and grad i start together
    # (3 pairs), then grad 3 alone; crossing, each pair takes 20 s, not 10
    plan, on_bed = steps.makespan(2, 4, 1.0, 1.0, 10.0), bed.bed_makespan(2, 4, 1.0, 1.0, 10.0)
    assert on_bed - plan == pytest.approx(3 * 10.0)
    assert steps.makespan(2, 4, 1.0, 1.0, 10.0) == plan  # the plan's own schedule is left as it was


def test_powersgds_all_reduces_one_after_another_draw_on_the_shapers_bucket_refilled_between_them():
    """tbf's bucket refills at the link's rate while each all-reduce's latency passes: on the bed P's 13.8 KB
    crossed in about its latency after the first call (benchmarks/plan_comm_parts.py); the plan's one
    all-reduce of their 31.7 KB took the burst once and the rest at the rate."""
    from dtrain.plan import cluster
    from dtrain.plan.costs import Group, Links

    f = bed.sized_fit("all_reduce", SECONDS, 2)
    links = Links(between="nodes", ranks=2, backend="gloo", figures={"all_reduce": f})
    c = cluster.with_links(cluster.build({"device": "cpu", "nodes": 2}), {"inter": links})
    g, lm = Group(2, 1), [7168, 13824, 10752]  # lm-20m's uncompressed rest, P, Q (bytes)
    rate, lat = f.by_size[0][1], 2 * f.lat
    assert bed.refilled_chain(lm, g, c) == pytest.approx(3 * lat)  # each call's bytes within what the bucket holds
    one = costs.allreduce(sum(lm), g, c) + 2 * costs.allreduce(4, g, c)  # the plan's pricing on the bed's links
    assert one == pytest.approx(3 * lat + (sum(lm) - f.burst) / rate, rel=1e-2)  # 20.7 ms where the chain takes 14.0
    # a larger last call: the bucket holds what was left plus a latency's refill, the rest at the rate
    left = min(f.burst, f.burst - 7168 + rate * lat) - 13824 + rate * lat
    assert bed.refilled_chain([7168, 13824, 40000], g, c) == pytest.approx(3 * lat + (40000 - left) / rate)
    plain = cluster.with_links(c, {"inter": Links(between="nodes", ranks=2, backend="gloo",
                                                  figures={"all_reduce": costs.fit("all_reduce", SECONDS, 2)})})
    assert bed.refilled_chain(lm, g, plain) == pytest.approx(sum(costs.allreduce(b, g, plain) for b in lm))  # no bucket


def test_the_bed_plan_prices_powersgd_call_by_call():
    from dtrain.plan.profile import ModelProfile

    prof = ModelProfile(name="m", params=10_000, fwd_flops=1.0, act_bytes=1.0, matrices=((64, 100), (4, 4)))
    assert bed.powersgd_calls(prof, 2) == [10_000 - 6400, 2 * 64, 2 * 100]  # the 4 x 4 stays whole (16 < 2 x 2 x 8)
    from dtrain.plan.steps import powersgd_elements

    assert sum(bed.powersgd_calls(prof, 2)) == powersgd_elements(prof, 2)
