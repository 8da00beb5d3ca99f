"""A pipeline schedule played out in time: each stage runs torch's order of operations
(``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B``), each activation and
gradient crosses its link (one per direction between neighbouring stages) one after another, and a
stage waits where torch's schedule waits.

torch's 1F1B fires each send together with the next receive and waits for both, and in warm-up
waits for the previous send before firing the next; GPipe fires its sends as it goes and waits for
them all at the end of the forwards and of the backwards. torch posts a receive where it waits for
it, and a send moves no data before its receiver has posted the receive and said so: a transfer
starts at the later of its send and its receive's post plus one ``latency`` (the notice crossing),
holds its link for its time less that latency, and arrives one latency after its last byte left.
With transfers of no time this gives the textbook (m + p - 1) slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Link:
    """One direction between two neighbouring stages: transfers in the order they were fired."""

    hop: float
    latency: float = 0.0
    """Seconds one way of a message of no size: the receive's notice, and each transfer's last byte."""
    free: float = 0.0
    ends: dict[int, float] = field(default_factory=dict)
    fired: dict[int, float] = field(default_factory=dict)
    posted: dict[int, float] = field(default_factory=dict)

    def fire(self, mb: int, at: float) -> None:
        self.fired.setdefault(mb, at)
        self._move(mb)

    def post(self, mb: int, at: float) -> None:
        self.posted.setdefault(mb, at)
        self._move(mb)

    def _move(self, mb: int) -> None:
        """The transfer once both its send is fired and its receive posted (both come in order)."""
        if mb in self.ends or mb not in self.fired or mb not in self.posted:
            return
        start = max(self.free, self.fired[mb], self.posted[mb] + self.latency)
        end = start + max(0.0, self.hop - self.latency)
        self.free = end if end > start else self.free  # a transfer of no wire time leaves the link as it was
        self.ends[mb] = end + min(self.latency, self.hop)


def _program(s: int, p: int, m: int, schedule: str) -> list[tuple]:
    """Stage ``s``'s operations: ("F"|"B", mb), ("fire", link, mb), ("wait", [(link, mb), ...])."""
    first, last = s == 0, s == p - 1
    recv_act = [] if first else [("act", s - 1)]
    recv_grad = [] if last else [("grad", s)]
    send_act = [] if last else [("act", s)]
    send_grad = [] if first else [("grad", s - 1)]
    ops: list[tuple] = []
    if schedule == "gpipe":
        for i in range(m):
            ops += [("wait", [(k, i) for k in recv_act]), ("F", i)] + [("fire", k, i) for k in send_act]
        ops.append(("wait", [(k, i) for k in send_act for i in range(m)]))
        for i in range(m):
            ops += [("wait", [(k, i) for k in recv_grad]), ("B", i)] + [("fire", k, i) for k in send_grad]
        ops.append(("wait", [(k, i) for k in send_grad for i in range(m)]))
        return ops
    warmup, f, b = min(m, p - s), 0, 0
    for _ in range(warmup):
        ops += [("wait", [(k, f) for k in recv_act]), ("F", f), ("wait", [(k, f - 1) for k in send_act if f > 0])]
        if f < warmup - 1:
            ops += [("fire", k, f) for k in send_act]
        f += 1
    pending = [(k, f - 1) for k in send_act]  # the last warm-up send, fused with the first backward's receive
    while b < m:
        ops += [("fire", k, i) for k, i in pending] + [("wait", pending + [(k, b) for k in recv_grad]), ("B", b)]
        pending, b = [(k, b) for k in send_grad], b + 1
        if f < m:
            ops += [("fire", k, i) for k, i in pending] + [("wait", pending + [(k, f) for k in recv_act]), ("F", f)]
            pending, f = [(k, f) for k in send_act], f + 1
    ops += [("fire", k, i) for k, i in pending] + [("wait", pending)]
    return ops


def makespan(p: int, m: int, fwd: float, bwd: float, hop: float, schedule: str = "1f1b", latency: float = 0.0) -> float:
    """Seconds from the first forward to the last stage's end: ``p`` stages of ``m`` micro-batches,
    each ``fwd`` + ``bwd`` seconds on every stage, each transfer ``hop`` seconds from its start to
    its arrival (``latency`` of it one way) once its receive is posted and the notice has crossed."""
    links = {(k, s): _Link(hop, latency) for k in ("act", "grad") for s in range(p - 1)}
    receiver = {(k, s): s + 1 if k == "act" else s for k, s in links}
    programs = [_program(s, p, m, schedule) for s in range(p)]
    pc, clock = [0] * p, [0.0] * p
    while any(pc[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(programs[s]):
                op = programs[s][pc[s]]
                if op[0] == "wait":
                    for k, i in op[1]:
                        if receiver[k] == s:  # torch posts a receive where it waits for it
                            links[k].post(i, clock[s])
                    needed = [links[k].ends.get(i) for k, i in op[1]]
                    if any(t is None for t in needed):
                        break  # the other stage has not fired it yet
                    clock[s] = max([clock[s], *needed])
                elif op[0] == "fire":
                    links[op[1]].fire(op[2], clock[s])
                else:
                    clock[s] += fwd if op[0] == "F" else bwd
                pc[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule deadlocked (p={p}, m={m}, {schedule})")  # a bug of this model
    return max(clock)
