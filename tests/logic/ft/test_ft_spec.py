"""What bounds a new quorum's start (``FaultTolerance.connect_s``): the Lighthouse's heartbeat
timeout and a second, never more than ``step-timeout``."""

from __future__ import annotations

import pytest

from dtrain.ft import FaultTolerance


@pytest.mark.parametrize("text, connect_s", [
    ("", 3.0),                                  # heartbeat 2 s
    ("heartbeat=1", 2.0),                       # the bed's setting
    ("heartbeat=1,step-timeout=600", 2.0),      # a long collective does not lengthen the start
    ("heartbeat=5,step-timeout=4", 4.0),        # nor is the start ever given longer than a step
])
def test_a_quorums_start_is_bounded_by_the_heartbeat_not_the_step_timeout(text, connect_s):
    assert FaultTolerance.parse(text).connect_s == connect_s
