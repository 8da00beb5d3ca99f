"""A plan on the screen (a rich table when rich is installed, plain text otherwise), as one JSON
object, and as a chart (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import shlex
import sys
from typing import TextIO

from . import Plan

COLUMNS = ("#", "layout", "comm", "step ms", "samples/s", "scaling", "exposed comm ms", "state MiB", "peak MiB", "fits")


def rows(plan: Plan, top: int | None = None) -> list[tuple[str, ...]]:
    out = []
    for i, p in enumerate(plan.predictions[:top] if top else plan.predictions, 1):
        d = p.as_dict(plan.cluster.world_size)
        eff = d["scaling_efficiency"]
        out.append((str(i), d["layout"], d["comm"], f"{d['step_ms']:.2f}", f"{d['samples_per_s']:,.1f}",
                    "-" if eff is None else f"{eff:.0%}", f"{d['exposed_comm_ms']:.2f}", f"{d['state_mib_per_rank']:,.1f}",
                    f"{d['peak_mib_per_rank']:,.0f}", "yes" if d["fits"] else f"no (+{-d['mem_headroom_mib']:,.0f} MiB)"))
    return out


def summary(plan: Plan) -> list[str]:
    c, prof, s = plan.cluster, plan.profile, plan.settings
    lines = [f"dtrain plan: {prof.name} ({prof.params:,} parameters, {prof.fwd_flops * (1 + prof.bwd_ratio) / 1e9:.4g} GFLOP "
             f"per sample fwd+bwd), batch {s.batch} per process, {s.precision}, {s.optimizer}; "
             f"{c.nodes} node(s) x {c.procs_per_node} process(es) of {c.device.name}"]
    t = prof.timing
    if t is not None:
        lines.append(f"profile: forward {t.fwd_s * 1e3:.2f} ms, backward {t.bwd_s * 1e3:.2f} ms, optimizer {t.opt_s * 1e3:.2f} ms, "
                     f"data {t.data_s * 1e3:.2f} ms per batch of {t.batch} ({t.threads} thread(s); "
                     f"{(prof.achieved_flops or 0) / 1e9:.1f} GFLOP/s achieved)")
    m = prof.machinery
    if m is not None:
        extra = ", ".join(f"{k} +{sum(m.extra(k)) * 1e3:.1f}" for k in m.steps if k not in ("plain", "micro", "pp"))
        pp = f"; pipeline schedule {m.steps['pp'].forward * 1e3:.1f} ms per batch" if "pp" in m.steps else ""
        lines.append(f"layouts' own CPU cost per step, ms (world of one, {m.rounds} rounds): {extra or '-'}{pp}; "
                     f"a worker's memory before its model {m.rss.get('baseline', 0) / 2**20:,.0f} MiB")
    for where, got in c.links.items():
        figs = ", ".join(f"{k} {f.lat * 1e6:.0f} us + {f.bw * 8 / 1e9:.3g} Gbit/s" for k, f in got.figures.items())
        lines.append(f"links {where} (measured between {got.ranks} {got.between}): {figs}")
    return lines


def best_line(plan: Plan) -> str:
    best = plan.best
    if best is None:
        return "best: none fits in memory; lower --batch-size, add --activation-checkpointing, or add processes."
    line = (f"best: {best.layout.label()}  ->  dtrain train {' '.join(best.layout.train_args())} "
            f"({best.step_s * 1e3:.2f} ms per step, {best.samples_per_s:,.1f} samples/s)")
    exact = plan.best_exact
    if exact is not None and exact is not best:
        line += (f"\nbest with exact gradients (--comm none): {exact.layout.label()}  ->  dtrain train "
                 f"{' '.join(exact.layout.train_args())} ({exact.step_s * 1e3:.2f} ms, {exact.samples_per_s:,.1f} samples/s)")
    return line


BENCH_METHODS = ("ddp", "zero1", "fsdp")  # `dtrain bench` methods of the same name; the others run as --parallel


def close_lines(plan: Plan, task_flags: tuple[str, ...] = ()) -> list[str]:
    """A close call's layouts and the command that measures them (`dtrain bench`; on several nodes, `dtrain train`)."""
    best, close = plan.best, plan.close_to(plan.best)
    if best is None or not close:
        return []
    names = ", ".join(f"{p.layout.label()} ({p.samples_per_s:,.1f} samples/s)" for p in close)
    lines = [f"close call: {names} within {plan.margin:.0%} of the best's speed, about the plan's own error "
             f"(docs/plan.md, its validation); measure them before a long run:"]
    if plan.cluster.nodes == 1:
        methods, extra = ["ddp"], []
        for p in (best, *close):
            lay = p.layout
            if lay.comm != "none":
                extra += ["--comm", lay.comm]
            elif lay.name in BENCH_METHODS:
                methods += [] if lay.name in methods else [lay.name]
            else:
                extra += ["--parallel", str(lay.dims)]
        command = ["dtrain", "bench", *task_flags, "-n", str(plan.cluster.procs_per_node), "--methods", ",".join(methods), *extra, "--rounds", "3"]
        lines.append(f"  {shlex.join(command)}")
    else:
        each = " | ".join(shlex.join(p.layout.train_args()) for p in (best, *close))
        lines.append(f"  a short run of each on your nodes ({shlex.join(['dtrain', 'train', *task_flags, '--max-steps', '100'])} ...): {each}")
    return lines


def print_table(plan: Plan, *, top: int | None = None, out: TextIO | None = None, assumptions: bool = True,
                task_flags: tuple[str, ...] = ()) -> None:
    out = out or sys.stdout  # the stdout of the call, not of the first import (dtrain.cli.main run twice in a process)
    body = rows(plan, top)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    print(*summary(plan), sep="\n", file=out)
    if Console is not None and out is sys.stdout:
        table = Table(show_edge=False)
        for col in COLUMNS:
            table.add_column(col, justify="right" if col not in ("layout", "comm", "fits") else "left")
        for r in body:
            table.add_row(*r)
        Console(width=max(120, len(COLUMNS) * 14)).print(table)
    else:
        widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(COLUMNS)]
        print(*("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in [COLUMNS, *body]), sep="\n", file=out)
    print(best_line(plan), *close_lines(plan, task_flags), sep="\n", file=out)
    if assumptions:
        print("assumptions (dtrain plan --json lists them too):", *(f"  - {a}" for a in plan.as_dict()["assumptions"]),
              sep="\n", file=out)


def chart(plan: Plan, path: str) -> str:
    """A bar chart of samples/s per layout (hatched: does not fit) at ``path``; the CLI checked matplotlib first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preds = plan.predictions
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(preds) + 2), 4.5))
    bars = ax.bar(range(len(preds)), [p.samples_per_s for p in preds], color=["tab:blue" if p.fits else "lightgray" for p in preds])
    for bar in (b for b, p in zip(bars, preds) if not p.fits):
        bar.set_hatch("//")
    ax.set_xticks(range(len(preds)), [p.layout.label() for p in preds], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("predicted samples/s")
    ax.set_title(f"dtrain plan: {plan.profile.name} on {plan.cluster.nodes} x {plan.cluster.procs_per_node} {plan.cluster.device.name}"
                 " (gray: does not fit)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
