"""`dtrain train --fault-tolerance` on the network test bed: ``--hosts`` hosts (namespaces, by default
sharing one host name that resolves to loopback, as many images do), node 0 holding the Lighthouse
and replica group h0, node i replica group hi. Every process of the last host is killed (kill -9)
``--kills`` times and its command started again ``--restart-after`` seconds after each kill; then the
job runs to its end. ``--moments`` says where each kill lands, in turn (benchmarks/ft_moments.py):
random (1-4 s after the host is back in the quorum), save (while its checkpoint is being written),
heal (while it receives a peer's state after a restart), startup (after a start, before its first
quorum; the first kill, when its moment is startup, lands in the job's own start-up). Below, h1 is
the last host.

Per kill (as benchmarks/ft_kill.py): gap_s (kill -> h0's next committed step; a step whose vote was
in before the kill may land just after it), outage_s (the longest time between two of h0's committed
steps: the wait that spans the kill, and those starting up to 10 s after it), stall_s (h0's wall_s between its last step before and its
first after), lost (committed steps h0 took again: its next
step minus one, below its last), back_s (restart -> h1's first committed step, after healing from
a peer over the bed's network; only where the next kill does not land in that start), state_equal
(h1's model and optimizer against h0's at the first step both saved after h1 was back), and the
evidence of the moment. At the end: exit statuses, steps, the ledger's verdict, and whether the
final models are equal bit for bit.

    python3 benchmarks/ft_kill_bed.py --kills 5 --json benchmarks/results/ft_kill_bed-DATE.json    # root, iproute2
    python3 benchmarks/ft_kill_bed.py --kills 20 --moments startup,random,heal,save --pad-mb 24 --save-every 50 --steps 7000
    python3 benchmarks/ft_kill_bed.py --task images --kills 5 --moments random,heal,save,startup --save-every 40 --steps 600 --margin 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from ft_kill import MARGIN, MAX_STEPS, final_models_equal, join_s  # noqa: E402
from ft_moments import MOMENTS, Host, Tail, add_outages, emit, poll_until, states_equal  # noqa: E402
from tests.support.netbed import NetBed, unavailable_reason  # noqa: E402

from dtrain.ft.ledger import check_ft_ledger  # noqa: E402
from dtrain.ft.spec import DEFAULT_LIGHTHOUSE_PORT  # noqa: E402

REAL_TASKS = {
    "lm": ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=64"],
    "images": ["--task", "images", "--task-arg", "source=synthetic", "--task-arg", "model=resnet18", "--task-arg", "size=32",
               "--task-arg", "classes=10", "--task-arg", "samples=2048", "--batch-size", "16"],
}
"""``--task``: the real workloads at a size for a shared 2-core machine (``--task-arg`` adds to or overrides them).
They run at their own pace: no pace file, so the job cannot be held back; kills stop ``--margin`` steps before its end.
A heal is killed at a share of h0's newest checkpoint's size (images: large enough; lm's state is small)."""


def task_args(tmp: str, a: argparse.Namespace) -> list[str]:
    if a.task == "paced":
        return ["--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp}/pace", "--task-arg", f"pad_mb={a.pad_mb:g}"]
    return [*REAL_TASKS[a.task], *(x for kv in a.task_arg for x in ("--task-arg", kv))]


def command(tmp: str, rank: int, master: str, spec: str, a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--fault-tolerance", spec, "--nnodes", str(a.hosts), "--node-rank", str(rank),
            "--master-addr", master, "--replica-id", f"h{rank}", *task_args(tmp, a), "--epochs", "1000",
            "--max-steps", str(a.steps), "--ledger", f"{tmp}/ledger", "--metrics-file", f"{tmp}/metrics.jsonl",
            "--log-every", "1", "--checkpoint-dir", f"{tmp}/ckpt", "--save-every", str(a.save_every)]


class Run:
    """One job on the bed and its kills (see the module's docstring)."""

    def __init__(self, bed: NetBed, tmp: str, a: argparse.Namespace) -> None:
        self.bed, self.tmp, self.a = bed, tmp, a
        self.rng = random.Random(a.seed)
        self.v = bed.hosts - 1
        self.name = f"h{self.v}"
        self.metrics = Tail(f"{tmp}/metrics.jsonl")
        self.host = Host(bed, self.v, f"{tmp}/ckpt/replica-{self.name}")
        self.connect_s: list[float] = []  # start -> Lighthouse connection, of the starts that got there

    def mine(self, replica: str, after: float) -> list[dict]:
        return [r for r in self.metrics() if r["replica"] == replica and r["time"] > after]

    def step(self) -> int:
        return max((r["step"] for r in self.metrics()), default=0)

    def wait(self, ready, timeout: float, what: str) -> None:
        if not poll_until(ready, timeout, every=0.02):
            raise SystemExit(f"not within {timeout:.0f} s: {what}")

    def back(self, row: dict) -> None:
        """Wait for the victim's first commit since its start; what it took, and its state against h0's."""
        lh = (self.bed.addresses[0], DEFAULT_LIGHTHOUSE_PORT)
        connected = None
        def ready() -> bool:
            nonlocal connected
            if connected is None and self.host.connected(*lh):
                connected = time.time()
            return bool(self.mine(self.name, self.host.started))
        self.wait(ready, 240, f"kill {row.get('kill')}: {self.name} back")
        first = self.mine(self.name, self.host.started)[0]
        if connected is not None:
            self.connect_s.append(connected - self.host.started)
        row.update(back_s=round(first["time"] - self.host.started, 3), back_in_run_s=first["wall_s"],
                   join_s=join_s(open(f"{self.tmp}/{self.name}.txt").read()), healed_to_step=first["step"] - 1)
        row["state_equal_at_step"], row["state_equal"] = states_equal(f"{self.tmp}/ckpt", ("h0", self.name), first["step"])

    def state_bytes(self) -> float:
        """What a heal sends, about: the paced task's frozen pad; a real task's state as h0 last saved it
        (its model and optimizer are the most of its checkpoint)."""
        if self.a.task == "paced":
            return self.a.pad_mb * 2**20
        folder = f"{self.tmp}/ckpt/replica-h0"
        steps = sorted(n for n in os.listdir(folder) if n.startswith("step-"))
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f"{folder}/{steps[-1]}") for f in fs) if steps else 0

    def land(self, moment: str) -> tuple[float, dict]:
        """Kill the victim at ``moment``; the kill's time and the evidence of where it landed."""
        host, lh = self.host, (self.bed.addresses[0], DEFAULT_LIGHTHOUSE_PORT)
        if moment == "random":
            time.sleep(self.rng.uniform(1.0, 4.0))
        elif moment == "save":
            found = poll_until(host.saving, 120)
            killed = host.kill()
            return killed, {"save_found": found, "save_cut": host.saving()}  # the .tmp-step-* folder left behind
        elif moment == "heal":
            poll_until(host.in_namespace, 30)
            base, share = host.rx_bytes(), self.rng.uniform(0.1, 0.8)
            want = share * self.state_bytes()
            found = poll_until(lambda: host.rx_bytes() - base >= want or bool(self.mine(self.name, host.started)), 240)
            evidence = {"heal_share": round(share, 2), "rx_mib": round((host.rx_bytes() - base) / 2**20, 1)}
            committed = bool(self.mine(self.name, host.started))
            killed = host.kill()
            return killed, {**evidence, "heal_found": found and not committed, "victim_committed": committed}
        elif moment == "startup":
            est = statistics.median(self.connect_s) if self.connect_s else 4.0
            until = host.started + self.rng.uniform(0.1, 0.95) * est
            # at the drawn moment, or as the host reaches the Lighthouse (its start may be slower this time)
            poll_until(lambda: time.time() >= until or host.connected(*lh) or bool(self.mine(self.name, host.started)), 300, 0.01)
            evidence = {"after_start_s": round(time.time() - host.started, 2), "lighthouse_connected": host.connected(*lh),
                        "victim_committed": bool(self.mine(self.name, host.started))}
            return host.kill(), evidence
        return host.kill(), {}

    def one_kill(self, i: int, moment: str, then: str | None) -> dict:
        before_kill = [r for r in self.metrics() if r["replica"] == "h0"]
        killed, evidence = self.land(moment)
        before = [r for r in self.metrics() if r["replica"] == "h0" and r["time"] <= killed] or before_kill
        self.wait(lambda: bool(self.mine("h0", killed)), 180, f"kill {i}: h0's next step")
        after = self.mine("h0", killed)[0]
        last = before[-1]["step"] if before else None
        row = {"kill": i, "moment": moment, **evidence, "killed_at": round(killed, 3), "gap_s": round(after["time"] - killed, 3),
               "stall_s": round(after["wall_s"] - before[-1]["wall_s"], 3) if before else None,
               "step_at_kill": last, "next_step": after["step"], "lost": max(0, (last or 0) + 1 - after["step"]),
               "participants_after": after["participants"], "load1": round(os.getloadavg()[0], 2)}
        time.sleep(max(0.0, self.a.restart_after - (time.time() - killed)))
        self.host.started_now(self.bed.restart(self.v))
        if then not in ("heal", "startup"):  # else the next kill lands in this start
            self.back(row)
        print(json.dumps(row), flush=True)
        return row

    def kills(self) -> list[dict]:
        moments, rows = self.a.moments, []
        if moments[0] != "startup":  # every group in one quorum (the first one up may have started alone, min=1)
            names = {f"h{r}" for r in range(self.bed.hosts)}
            self.wait(lambda: {r["replica"] for r in self.metrics()[-5 * self.bed.hosts:]
                               if r["participants"] == self.bed.hosts} == names, 300, "every group in the quorum")
        for i in range(self.a.kills):
            if self.step() > self.a.steps - self.a.margin:
                break
            then = moments[(i + 1) % len(moments)] if i + 1 < self.a.kills else None
            rows.append(self.one_kill(i, moments[i % len(moments)], then))
        if rows and "back_s" not in rows[-1]:  # stopped before the kill meant to land in the last start
            self.back(rows[-1])
        return rows


def run(a: argparse.Namespace) -> dict:
    spec = f"min=1,heartbeat={a.heartbeat:g},timeout=60"
    tmp = tempfile.mkdtemp(prefix="ft_kill_bed-")
    with open(f"{tmp}/pace", "w") as f:
        f.write("0.004")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    outs = [open(f"{tmp}/h{r}.txt", "w") for r in range(a.hosts)]
    load = [os.getloadavg()[0]]
    with NetBed(hosts=a.hosts, shared_name=a.shared_name or None) as bed:
        job = Run(bed, tmp, a)
        procs = [bed.popen(r, command(tmp, r, bed.addresses[0], spec, a), env=env, stdout=outs[r]) for r in range(a.hosts)]
        job.host.started_now(procs[-1])
        rows = job.kills()
        load.append(os.getloadavg()[0])
        with open(f"{tmp}/pace", "w") as f:
            f.write("0")
        codes = [p.wait(timeout=900) for p in procs[:-1]] + [bed._procs[-1].wait(timeout=900)]  # the victim's last start
    for f in outs:
        f.close()
    results = []
    for r in range(a.hosts):
        with open(f"{tmp}/h{r}.txt") as f:
            results += [json.loads(line) for line in f if line.startswith("{")]
    report, disagree = check_ft_ledger(f"{tmp}/ledger")
    add_outages(rows, Tail(f"{tmp}/metrics.jsonl")())
    return {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores; NetBed {a.hosts} hosts, shared host name {a.shared_name!r}",
        "torch": torch.__version__, "command": " ".join(["python3", "benchmarks/ft_kill_bed.py", *sys.argv[1:]]),
        "load1_start_end": [round(x, 2) for x in load], "kills": len(rows), "exit_status": codes,
        "completed": all(c == 0 for c in codes), **summary(rows),
        "results": [{k: r.get(k) for k in ("replica", "steps", "test_acc", "val_loss", "fault_tolerance")} for r in results],
        "ledger_exactly_once": report.ok and not disagree, "ledger_steps": report.steps_kept,
        "final_models_equal": final_models_equal(tmp, ("h0", f"h{a.hosts - 1}")), "rows": rows, "folder": tmp,
    }


def summary(rows: list[dict]) -> dict:
    def spread(key: str, of: list[dict]) -> dict | None:
        values = [r[key] for r in of if r.get(key) is not None]
        return {"median": round(statistics.median(values), 3), "max": max(values), "n": len(values)} if values else None

    by_moment = {m: {"kills": len(of), "gap_s": spread("gap_s", [r for r in of if r["step_at_kill"] is not None]),
                     "lost": sum(r["lost"] for r in of)}
                 for m in MOMENTS if (of := [r for r in rows if r["moment"] == m])}
    equal = [r["state_equal"] for r in rows if r.get("state_equal") is not None]
    running = [r for r in rows if r["step_at_kill"] is not None]  # else h0 had no step yet: its next is its first
    return {"gap_s": spread("gap_s", running), "first_step_after_a_kill_before_any_s": spread("gap_s", [r for r in rows if r not in running]),
            "stall_s": spread("stall_s", rows), "back_s": spread("back_s", rows),
            "outage_s": spread("outage_s", running), "join_s": spread("join_s", rows), "lost": sum(r["lost"] for r in rows), "by_moment": by_moment,
            "state_equal_after_back": f"{sum(equal)}/{len(equal)}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--hosts", type=int, default=2, help="hosts of the bed; the last one is killed and restarted")
    p.add_argument("--moments", default="random", help=f"comma list, taken in turn: {', '.join(MOMENTS)}")
    p.add_argument("--restart-after", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=MAX_STEPS, help="the job's length (kills stop 400 steps before its end)")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--pad-mb", type=float, default=0.0, help="a frozen parameter of this size: slow saves and heals")
    p.add_argument("--task", default="paced", choices=("paced", *REAL_TASKS), help="paced: the small paced MLP; lm, images: the real tasks")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="for lm or images (repeatable)")
    p.add_argument("--margin", type=int, default=MARGIN, help="no kill once the job is this many steps from its end")
    p.add_argument("--shared-name", default="vm", help="the host name both hosts share ('' for names of their own)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.moments = a.moments.split(",")
    if set(a.moments) - set(MOMENTS) or ("heal" in a.moments and not a.pad_mb and a.task == "paced"):
        p.error(f"--moments takes {', '.join(MOMENTS)}; heal needs --pad-mb with the paced task (a state large enough to kill it in transit)")
    reason = unavailable_reason()
    if reason:
        print(f"the network test bed is unavailable here: {reason}")
        return 2
    out = run(a)
    emit(out, a.json)
    ok = out["completed"] and out["ledger_exactly_once"] and out["final_models_equal"] and out["lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
