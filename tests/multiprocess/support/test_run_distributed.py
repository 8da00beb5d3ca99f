"""dtrain.launch.local.run_distributed (what `dtrain plan`'s profiles run on) when its ranks die."""

from __future__ import annotations

import os
import time

import pytest

from dtrain.launch.local import DistributedTestError, run_distributed


def _exit_at_once() -> None:
    os._exit(3)


def test_ranks_that_exit_without_a_result_fail_at_once_and_say_so():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0, 1\] exited without a result \(rank 0: exit 3, rank 1: exit 3\)"):
        run_distributed(_exit_at_once, world_size=2, timeout=120)
    assert time.monotonic() - t0 < 60  # not the 120 s timeout
