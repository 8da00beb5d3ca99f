"""Run a command and report the peak resident set size (VmHWM) of every process it starts, by
process: one JSON line on stderr at the end, ``{"peak_rss": [{"pid", "cmd", "peak_mib"}, ...]}``.

The kernel keeps each process's high-water mark (``VmHWM`` in ``/proc/PID/status``); this
wrapper reads it for every descendant every ``--every`` seconds until each exits, so a peak
reached in the last interval before a process exits is missed (the training workers' peak
comes from their steps, long before). Used by plan_validation.py to hold `dtrain plan`'s
predicted peak per rank against the measured one.

    python3 benchmarks/peak_rss.py [--every 0.1] -- COMMAND ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return out


def _tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    return seen


def _hwm_kib(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            hwm = next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), None)
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        return None
    return None if hwm is None else (hwm, cmd)


def main() -> int:
    args = sys.argv[1:]
    every = 0.1
    if args[:1] == ["--every"]:
        every, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    proc = subprocess.Popen(args)
    peaks: dict[int, tuple[int, str]] = {}
    while proc.poll() is None:
        for pid in _tree(proc.pid)[1:]:  # not the command itself before exec: the tree below
            got = _hwm_kib(pid)
            if got is not None and got[0] >= peaks.get(pid, (0, ""))[0]:
                peaks[pid] = got
        got = _hwm_kib(proc.pid)
        if got is not None and got[0] >= peaks.get(proc.pid, (0, ""))[0]:
            peaks[proc.pid] = got
        time.sleep(every)
    rows = [{"pid": pid, "cmd": cmd[:160], "peak_mib": round(kib / 1024, 1)} for pid, (kib, cmd) in sorted(peaks.items())]
    print(json.dumps({"peak_rss": rows}), file=sys.stderr, flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
