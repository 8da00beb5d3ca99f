"""Does each of the plan's less obvious terms earn its place? (issue 52, item 2: a term stays only if
it changes some prediction by more than 5% on one of the reference clusters.)

For each term, every candidate layout of a few models is predicted on each reference cluster with
the term and without it (the term switched off by patching the plan's function in this process),
and the largest change of a predicted step time is printed (``mem``: of memory per rank), with whether
the pick changed. A calculation: no GPU, no network, a few seconds. Terms removed for moving no
prediction by 5%: benchmarks/results/52-plan-terms-2026-11-29.md.

    PYTHONPATH=src python3 benchmarks/plan_terms.py
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from plan_published import from_counts  # noqa: E402 - a model given by its totals

from dtrain.plan import Settings, cluster, costs, make_plan, model, steps  # noqa: E402
from dtrain.plan.machinery import (  # noqa: E402
    Machinery,
    Phases,
    Timing,  # noqa: E402
)
from dtrain.plan.profile import transformer  # noqa: E402

CLUSTERS = {
    "4 x 8 H100, NVLink + 8x400G IB": {"device": "h100", "nodes": 4, "procs_per_node": 8},
    "2 x 8 A100, 100GbE": {"device": "a100", "nodes": 2, "procs_per_node": 8, "inter_gbit": 100, "inter_latency_us": 30},
    "4 CPU nodes, 10GbE": {"device": "cpu", "nodes": 4, "procs_per_node": 1, "peak_tflops": 0.5, "inter_gbit": 10,
                           "inter_latency_us": 50},
    "2 CPU nodes, 1GbE": {"device": "cpu", "nodes": 2, "procs_per_node": 1, "peak_tflops": 0.5, "inter_gbit": 1,
                          "inter_latency_us": 100},
}
GPT2 = transformer("GPT-2 124M", layers=12, width=768, ffn=3072, heads=12, kv_heads=12, vocab=50257, seq=1024, tied=True, gated=False)
MODELS = {
    "gpu": [(transformer("Llama 3.1 8B", layers=32, width=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192), 1),
            (GPT2, 16)],
    "cpu": [(transformer("GPT 6x512", layers=6, width=512, ffn=2048, heads=8, kv_heads=8, vocab=8192, seq=256, gated=False), 8),
            (from_counts("MLP 1M", params=1_000_000, fwd_flops=2e6, act_bytes=20_000.0, layers=4, out_bytes=40.0), 64),
            (from_counts("digits' MLP", params=26_122, fwd_flops=46_000.0, act_bytes=2_000.0, layers=2, out_bytes=40.0), 32)],
}


def cpu_measured(prof, batch: int):
    """A CPU profile with measured phases and each layout's own CPU cost in the proportions `dtrain
    plan` measured for digits on this machine (fsdp +5.9 ms, zero1 +3.0, ddp +0.3 on a 0.9 ms step)."""
    step = prof.fwd_flops * 3 * batch / 0.5e12
    k = step / 0.9e-3
    ph = lambda f, b, o: Phases(f * k, b * k, o * k)  # noqa: E731
    m = Machinery(batch=batch, microbatches=4, steps={
        "plain": ph(0.19e-3, 0.25e-3, 0.43e-3), "ddp:none": ph(0.29e-3, 0.45e-3, 0.43e-3), "ddp:bf16": ph(0.3e-3, 0.55e-3, 0.43e-3),
        "ddp:powersgd:2": ph(0.3e-3, 1.7e-3, 0.43e-3), "ddp:localsgd:16": ph(0.2e-3, 0.3e-3, 0.48e-3),
        "zero1": ph(0.3e-3, 0.4e-3, 3.2e-3), "fsdp": ph(2.0e-3, 3.5e-3, 1.2e-3)})
    # as `dtrain plan` measured lm-1g on this machine (benchmarks/results/31-plan/bed-run34-raw.jsonl): a pipeline's
    # micro-batch and its one-stage schedule over the plain step, a worker's memory before its model
    fb = sum(ph(0.19e-3, 0.25e-3, 0.0)) / (17.323 + 22.193)
    m.steps.update(micro=Phases(5.333 * fb, 7.232 * fb, 0.0), pp=Phases(51.387 * fb, 0.0, 0.43e-3 * k * 4.708 / 5.199))
    m = replace(m, rss={"baseline": 677.1 * 2**20})
    t = Timing(batch=batch, fwd_s=prof.fwd_flops * batch / 0.5e12, bwd_s=2 * prof.fwd_flops * batch / 0.5e12, opt_s=0.43e-3 * k,
               threads=1, device="cpu")
    return replace(prof, timing=t, machinery=m)


def _no_latency_wait(p, m, fwd, bwd, hop, schedule="1f1b", latency=0.0, _real=steps.makespan):
    return _real(p, m, fwd, bwd, hop, schedule, 0.0)


TERMS = {
    "log steps' collectives (amortised)": lambda: mock.patch.object(steps, "log_step", lambda c, s: 0.0),
    "pipeline: a send waits for its receive's post": lambda: mock.patch.object(steps, "makespan", _no_latency_wait),
    "groups sharing a node's NICs": lambda: mock.patch.object(
        steps, "group_of", lambda size, stride, ppn, _g=costs.group_of: replace(_g(size, stride, ppn), sharing=1)),
    "gloo reduce-scatter as an all-reduce": lambda: mock.patch.object(costs, "_reduce_is_allreduce", lambda g, c: False),
    "zero1: a latency per owner": lambda: mock.patch.object(
        costs, "broadcast", lambda n, g, c, messages=1, _b=costs.broadcast: _b(n, g, c)),
    "NCCL's tree all-reduce": "no-tree",
    "FSDP's prefetch one unit ahead": lambda: mock.patch.object(
        steps, "pipelined", lambda items, ahead, _p=steps.pipelined: _p(items, False)),
    "DDP's buckets overlapping backward": lambda: mock.patch.object(
        steps, "ddp_sync", lambda n, r, w, g, c, b, _d=steps.ddp_sync: _d(n, r, 0.0, g, c, b)),
    "layouts' own CPU cost (measured)": "machinery",
    "pipeline: measured micro-batches and schedule": "no-pp-steps",
    "pipeline: embedding first stage, head last": "no-ends",
    "optimizer step, memory-bound (GPU presets)": lambda: mock.patch.dict(model.OPT_BYTES_TOUCHED, {"adamw": 0}),
}


def plans(name: str, spec: dict, term) -> list:
    c = cluster.build({**spec, "tree": False} if term == "no-tree" else spec)
    out = []
    for prof, batch in MODELS["gpu" if c.is_gpu else "cpu"]:
        if term == "no-ends":  # what is outside the blocks, half on each end stage
            prof = replace(prof, before_blocks=None)
        if not c.is_gpu:
            prof = cpu_measured(prof, batch)
            if term == "machinery":
                prof = replace(prof, machinery=None)
            elif term == "no-pp-steps":
                prof = replace(prof, machinery=replace(prof.machinery, steps={
                    k: v for k, v in prof.machinery.steps.items() if k not in ("micro", "pp")}))
        precision = "bf16-mixed" if c.is_gpu else "fp32"
        s = Settings(batch=batch, precision=precision, param_comm_bytes=2 if c.is_gpu else 4, optimizer="adamw")
        ctx = term() if callable(term) else contextlib.nullcontext()
        with ctx:
            out.append(make_plan(prof, c, s))
    return out


def main() -> int:
    base = {name: plans(name, spec, None) for name, spec in CLUSTERS.items()}
    print(f"{'term':48s} " + " ".join(f"{n[:26]:>26s}" for n in CLUSTERS))
    for term, patch in TERMS.items():
        cells = []
        for name, spec in CLUSTERS.items():
            worst, mem, picks = 0.0, 0.0, 0
            for with_it, without in zip(base[name], plans(name, spec, patch)):
                by = {(p.layout.name, p.layout.comm): p for p in without.predictions}
                for p in with_it.predictions:
                    q = by[(p.layout.name, p.layout.comm)]
                    worst, mem = max(worst, abs(q.step_s / p.step_s - 1)), max(mem, abs(q.mem_bytes / p.mem_bytes - 1))
                picks += (with_it.best and without.best and with_it.best.layout != without.best.layout) or 0
            cells.append(f"{worst:>9.1%}{f' mem {mem:.1%}' if mem > 0 else '':>11s}{' pick' + str(picks) if picks else '':>6s}")
        print(f"{term:48s} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
