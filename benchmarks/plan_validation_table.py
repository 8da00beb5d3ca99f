"""The table and the goals' figures of plan_validation.py's rows (predicted vs measured per
configuration; per group, whether the plan's fastest was the fastest measured)."""

from __future__ import annotations

import statistics
from typing import NamedTuple


def picks_of(rows: list[dict]) -> list[tuple[str, dict, dict]]:
    """(group, the plan's fastest row, the fastest measured row) of each group."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    return [(g, max(rs, key=lambda r: r["pred_samples_per_s"]), max(rs, key=lambda r: r["meas_samples_per_s"]))
            for g, rs in groups.items()]


class Pick(NamedTuple):
    group: str
    plan: dict
    """The row the group's plan put fastest."""
    fastest: dict
    """The row measured fastest."""
    right: bool
    unsettled: bool
    """Missed, but the pick's runs overlap the fastest's (``runs_overlap``)."""
    close: bool
    """The plan put another configuration within ``margin`` of its best's samples/s (``dtrain.plan.MARGIN``)."""
    regret: float
    """How much faster the fastest measured than the pick (0 where right)."""


def judged(rows: list[dict], margin: float | None = None) -> list[Pick]:
    """Each group's pick in ``rows``, judged against the measured medians."""
    if margin is None:
        from dtrain.plan import MARGIN as margin
    out = []
    for name, bp, bm in picks_of(rows):
        right = bp["layout"] == bm["layout"] and bp["comm"] == bm["comm"]
        close = any(r is not bp and r["pred_samples_per_s"] * (1 + margin) >= bp["pred_samples_per_s"] for r in rows if r["group"] == name)
        out.append(Pick(name, bp, bm, right, not right and runs_overlap(bp, bm), close,
                        bm["meas_samples_per_s"] / bp["meas_samples_per_s"] - 1))
    return out


def ratio_errors(rows: list[dict]) -> dict[tuple[str, str, str], float]:
    """Error of each configuration's step time relative to its group's first (ddp none), predicted
    against measured: a load common to both cancels."""
    out, first = {}, {}
    for r in rows:
        base = first.setdefault(r["group"], r)
        pred = r["predicted_ms"] / base["predicted_ms"]
        meas = r["measured_ms"] / base["measured_ms"]
        out[(r["group"], r["layout"], r["comm"])] = pred / meas - 1
    return out


def _pair(pred: float | None, meas: float | None, fmt: str) -> str:
    return "-" if pred is None or meas is None else f"{pred:{fmt}} / {meas:{fmt}}"


def _load(r: dict) -> str:
    load = r["load"] if isinstance(r["load"], list) else [r["load"]]
    return "-".join(f"{float(v):.1f}" for v in (min(map(float, load)), max(map(float, load)))) if len(load) > 1 else f"{float(load[0]):.1f}"


def print_table(rows: list[dict]) -> None:
    ratios = ratio_errors(rows)
    print("\n| group | layout | comm | predicted ms (per run) | measured ms (per run) | error | error of ratio to group's first "
          "| state MiB pred / meas | peak MiB pred / meas | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ba = ", ".join(f"{v:.0f}" for v in r.get("predicted_runs_ms", r.get("predicted_before_after_ms", [])))
        runs = ", ".join(f"{v:.0f}" for v in r.get("measured_runs_ms", [r["measured_ms"]]))
        print(f"| {r['group']} | {r['layout']} | {r['comm']} | {r['predicted_ms']:.1f} ({ba}) | {r['measured_ms']:.1f} ({runs}) "
              f"| {r['error']:+.1%} | {ratios[(r['group'], r['layout'], r['comm'])]:+.1%} "
              f"| {_pair(r['pred_state_mib'], r['meas_state_mib'], '.2f')} | {_pair(r.get('pred_peak_mib'), r.get('meas_peak_mib'), '.0f')} "
              f"| {_load(r)} |")
    summary(rows, ratios)


def summary(rows: list[dict], ratios: dict) -> None:
    errs = [abs(r["error"]) for r in rows]
    rel = [abs(v) for v in ratios.values() if v != 0.0]
    print(f"\nstep time: median |error| {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(rows)} configurations"
          f" ({sum(e <= 0.10 for e in errs)} within 10%, {sum(e <= 0.25 for e in errs)} within 25%)")
    if rel:
        print(f"step time relative to the group's first configuration: median |error| {statistics.median(rel):.1%}, max {max(rel):.1%}")
    for key, name in (("state", "state memory"), ("peak", "peak memory")):
        mem = [abs(r[f"pred_{key}_mib"] / r[f"meas_{key}_mib"] - 1) for r in rows if r.get(f"meas_{key}_mib") and r.get(f"pred_{key}_mib")]
        if mem:
            print(f"{name} per rank: median |error| {statistics.median(mem):.1%}, max {max(mem):.1%} over {len(mem)} configurations")
    picks = judged(rows)  # the group's plan (all its layouts at one moment) against the measured medians
    for k in picks:
        bp, bm = k.plan, k.fastest
        print(f"{k.group}: plan picks {bp['layout']} {bp['comm']}; fastest measured {bm['layout']} {bm['comm']}"
              + ("" if k.right else f" (the pick measured {k.regret:.0%} slower than the fastest"
                 + ("; their runs overlap: the runs do not settle the order)" if k.unsettled else ")")))
    right, ties, regrets = sum(k.right for k in picks), sum(k.unsettled for k in picks), [k.regret for k in picks]
    print(f"fastest picked right in {right} of {len(picks)} groups"
          + (f"; of the {len(picks) - right} missed, {ties} unsettled (the pick's runs overlap the fastest's)" if ties else "")
          + f"; the pick measured a median {statistics.median(regrets):.1%}, at most {max(regrets):.1%} slower than the fastest")
    print(close_calls(picks))


def close_calls(picks: list[Pick], margin: float | None = None) -> str:
    """The picks split as `dtrain plan` flags them (``Pick.close``): right of the clear calls, of the close ones."""
    if margin is None:
        from dtrain.plan import MARGIN as margin
    clear = [k for k in picks if not k.close]
    close = [k for k in picks if k.close]
    return (f"picks the plan calls clear (runner-up predicted {margin:.0%} or more behind): {sum(k.right for k in clear)} of {len(clear)} "
            f"right; close calls (`dtrain plan` names them and the bench that orders them): {sum(k.right for k in close)} of {len(close)} right")


def runs_overlap(a: dict, b: dict) -> bool:
    """Whether two configurations' runs (two or more each) overlap: the slower median's fastest run
    is no slower than the faster median's slowest run, so the measured order is within the runs'
    own spread (one run each: no spread to judge by, never unsettled)."""
    ra, rb = a.get("measured_runs_ms", []), b.get("measured_runs_ms", [])
    if len(ra) < 2 or len(rb) < 2:
        return False
    slow, fast = (ra, rb) if a["measured_ms"] >= b["measured_ms"] else (rb, ra)
    return min(slow) <= max(fast)


def pick_tally(runs: dict[str, list[dict]], margin: float | None = None) -> None:
    """The picks of several bed runs (``runs``: a run's name and its rows), each group of each run
    one pick (``judged``): right, unsettled or missed; and how much slower the pick measured than
    the fastest."""
    if margin is None:
        from dtrain.plan import MARGIN as margin
    picks = []
    for run, rows in runs.items():
        for k in judged(rows, margin):
            picks.append(k)
            verdict = "right" if k.right else ("unsettled" if k.unsettled else "missed")
            print(f"{run} {k.group}: {verdict}; plan {k.plan['layout']} {k.plan['comm']}, fastest {k.fastest['layout']} {k.fastest['comm']}"
                  + ("" if k.right else f" ({k.regret:.1%} faster; runs {_runs(k.fastest)} against {_runs(k.plan)} ms)")
                  + (" [close call]" if k.close else ""))
    if not picks:
        print("no picks: the files hold no rows")
        return
    n, right, unsettled = len(picks), sum(k.right for k in picks), sum(k.unsettled for k in picks)
    close = [k for k in picks if k.close]
    close_right = sum(k.right for k in close)
    regrets = [k.regret for k in picks]
    print(f"\n{n} picks over {len(runs)} runs: right {right} ({right / n:.0%}); missed {n - right}, of them {unsettled} unsettled "
          f"(the runs overlap); right or unsettled {right + unsettled} ({(right + unsettled) / n:.0%})")
    print(f"clear calls (runner-up predicted {margin:.0%} or more behind): {right - close_right} of {n - len(close)} right; "
          f"close calls: {close_right} of {len(close)} right")
    print(f"the pick measured a median {statistics.median(regrets):.1%}, mean {statistics.mean(regrets):.1%}, at most "
          f"{max(regrets):.1%} slower than the fastest")


def _runs(r: dict) -> str:
    return "/".join(f"{v:.0f}" for v in r.get("measured_runs_ms", [r["measured_ms"]]))
