"""Close calls: layouts the plan predicts within its margin of the best are named, with the command
that measures them (`dtrain bench` on one node, a short `dtrain train` of each on several), in
the table, the JSON and `--parallel auto`'s line."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from dtrain.cli import build_parser
from dtrain.cli import train_auto as auto
from dtrain.parallel.dims import ParallelDims, parse
from dtrain.plan import MARGIN, Settings, make_plan, report
from dtrain.plan.layouts import Layout

from .test_plan import flat, toy

LAYOUTS = [Layout("ddp", ParallelDims(dp_replicate=2)), Layout("ddp", ParallelDims(dp_replicate=2), comm="powersgd:2"),
           Layout("fsdp", ParallelDims(dp_shard=2)), Layout("tp=2", parse("tp=2"))]


def _plan(nodes: int = 1, margin: float = MARGIN):
    c = flat(nodes=nodes, ppn=2 // nodes, inter_bw=1e8, intra_bw=1e8, lat=1e-3)
    plan = make_plan(toy(params=2_000_000), c, Settings(batch=8), layouts=LAYOUTS)
    return dataclasses.replace(plan, margin=margin)


def test_close_to_is_every_fitting_layout_within_the_margin_of_the_pick():
    plan = _plan()
    best, rates = plan.best, [p.samples_per_s for p in plan.predictions]
    assert len(set(rates)) == len(rates)  # distinct predictions: the margins below separate them
    assert plan.margin == MARGIN == 0.10
    assert dataclasses.replace(plan, margin=0.0).close_to(best) == []
    assert dataclasses.replace(plan, margin=3.0).close_to(best) == [p for p in plan.predictions[1:] if p.fits]
    # a margin between the second's and the third's distance from the best: the second only
    second, third = (best.samples_per_s / p.samples_per_s - 1 for p in plan.predictions[1:3])
    between = dataclasses.replace(plan, margin=(second + third) / 2)
    assert between.close_to(best) == [plan.predictions[1]]
    exact = between.close_to(plan.best_exact, exact=True)
    assert all(p.layout.comm == "none" and p is not plan.best_exact for p in exact)
    assert between.close_to(None) == []


def test_the_json_has_the_margin_and_the_close_calls():
    plan = _plan(margin=3.0)
    d = plan.as_dict()
    assert d["margin"] == 3.0
    assert [(r["layout"], r["comm"]) for r in d["close_to_best"]] == [(p.layout.name, p.layout.comm) for p in plan.close_to(plan.best)]
    assert all(r["comm"] == "none" for r in d["close_to_best_exact"]) and d["close_to_best_exact"]
    assert _plan(margin=0.0).as_dict()["close_to_best"] == []


def test_one_node_prints_a_bench_command_that_dtrain_bench_accepts():
    plan = _plan(margin=3.0)
    flags = ("--task", "synthetic", "--task-arg", "hidden=64", "--batch-size", "8")
    lines = report.close_lines(plan, flags)
    assert lines[0].startswith("close call: ") and "within 300% of the best's speed" in lines[0]
    for p in plan.close_to(plan.best):
        assert p.layout.label() in lines[0]
    argv = shlex.split(lines[1])
    assert argv[:2] == ["dtrain", "bench"]
    args = build_parser().parse_args(argv[1:])  # the printed command parses as `dtrain bench`
    assert args.methods.split(",") == ["ddp", "fsdp"] and args.comm == ["powersgd:2"] and args.parallel == ["tp=2"]
    assert (args.task, args.task_arg, args.batch_size, args.nproc, args.rounds) == ("synthetic", ["hidden=64"], 8, 2, 3)
    assert report.close_lines(_plan(margin=0.0), flags) == []


def test_several_nodes_print_each_layouts_train_flags():
    plan = _plan(nodes=2, margin=3.0)
    lines = report.close_lines(plan, ("--task", "lm"))
    assert "dtrain train --task lm --max-steps 100" in lines[1]
    for p in (plan.best, *plan.close_to(plan.best)):
        assert shlex.join(p.layout.train_args()) in lines[1]


def test_the_table_prints_the_close_call_after_the_best(capsys):
    import io

    out = io.StringIO()
    report.print_table(_plan(margin=3.0), out=out, assumptions=False, task_flags=("--task", "digits"))
    text = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(text) if line.startswith("best: "))
    assert any(line.startswith("close call: ") for line in text[at:])


@pytest.mark.parametrize("margin, close", [(0.0, False), (3.0, True)])
def test_parallel_auto_says_when_its_pick_is_a_close_call(margin, close):
    plan = _plan(margin=margin)
    line = auto.pick_line(plan, plan.best_exact)
    assert line.startswith(f"dtrain: --parallel auto: the plan picked {plan.best_exact.layout.label()}")
    assert ("a close call" in line) == close
