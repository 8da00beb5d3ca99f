"""``make_paced`` whose build waits while ``gate_file`` says ``hold``: the test holds a restarted
replica group's process back until its peer has finished the job (on a loaded machine the restart
could otherwise come back before the end, and heal from the peer instead)."""

import os
import time

from tests.user_task import make_paced


def make_gated(pace_file, gate_file, epochs="30"):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and os.path.exists(gate_file) and open(gate_file).read() == "hold":
        time.sleep(0.1)
    return make_paced(pace_file, epochs=epochs)
