"""What Linux's /proc says about this process and the machine's other load, for the layouts'
profile (plan/machinery.py): this process's resident set and its peak (which the profile resets
before the plain steps), and what else wants the cores while the profile runs: the other
sessions with a runnable thread where Linux shares the CPU between sessions first
(``kernel.sched_autogroup_enabled``), else the runnable threads besides this process's.
"""

from __future__ import annotations

import os


def status(key: str) -> float:
    """``key`` (VmRSS, VmHWM...) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        return next(float(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def autogroups_on() -> bool:
    """Whether Linux shares the CPU between sessions first (autogroups), so another session counts once."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as fh:
            return fh.read().strip() == "1"
    except OSError:
        return False


def runnable_others(by_group: bool) -> float | None:
    """What else wants the cores now: the other sessions (autogroups) with a runnable thread,
    where Linux shares the CPU between sessions first (``kernel.sched_autogroup_enabled``), else
    the runnable threads besides this one. None where /proc cannot tell."""
    mine = _group(os.getpid()) if by_group else None
    groups, threads = set(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        running = 0
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    running += fh.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue
        if running and int(pid) != os.getpid():
            threads += running
            if by_group and (g := _group(int(pid))) is not None and g != mine:
                groups.add(g)
    return float(len(groups)) if by_group else float(threads)


def _group(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/autogroup") as fh:
            return fh.read().split()[0]
    except (OSError, IndexError):
        return None
