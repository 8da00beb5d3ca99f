"""A frozen worker (SIGSTOP) is ended at once after the stall report, not after torch's 30 s
SIGTERM grace (launch/reaper.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from dtrain.launch.reaper import stopped_with_sigterm_pending
from tests.paths import TESTS
from tests.support import run_cli

FREEZE = TESTS / "scripts" / "freeze.py"


def test_a_stopped_process_with_sigterm_pending_is_recognised():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not stopped_with_sigterm_pending(proc.pid)  # running
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert not stopped_with_sigterm_pending(proc.pid)  # stopped, nothing asked of it
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert stopped_with_sigterm_pending(proc.pid)  # asked to end, and it cannot
    finally:
        proc.kill()
        proc.wait()
    assert not stopped_with_sigterm_pending(proc.pid)  # gone


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_frozen_worker_ends_the_job_well_before_the_30_s_grace(tmp_path):
    r = run_cli(["run", "-n", "2", "--stall-timeout", "3", "--run-dir", str(tmp_path), str(FREEZE)], timeout=180)
    ended = time.time()
    assert r.returncode == 124, r.stderr[-3000:]
    assert "rank 1 did not answer" in r.stderr and "stopped by the stall watchdog" in r.stderr, r.stderr[-3000:]
    frozen = float(re.search(r"frozen at ([0-9.]+)", r.stdout).group(1))
    # Before: stall timeout + 30 s of SIGTERM grace on the stopped worker (>= 33 s). A bound, not a timing.
    assert ended - frozen < 25, f"{ended - frozen:.1f} s from the freeze to the exit"
