"""tests/scripts/ft_loop.py held back while ``GATE_FILE`` says ``hold``: a test holds a restarted
replica group's script until its peer has finished the job (as gated_task.py does for dtrain train).

    GATE_FILE=F python tests/multiprocess/ft/gated_loop.py PACE_FILE OUT [ft_loop.py's options]
"""

import os
import pathlib
import runpy
import sys
import time

gate = os.environ["GATE_FILE"]
deadline = time.monotonic() + 120
while time.monotonic() < deadline and os.path.exists(gate) and open(gate).read() == "hold":
    time.sleep(0.1)
loop = str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "scripts" / "ft_loop.py")
sys.argv = [loop, *sys.argv[1:]]
runpy.run_path(loop, run_name="__main__")
