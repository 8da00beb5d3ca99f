"""A replica group that kills itself (-9) as soon as the Lighthouse has put it in a quorum, before
it reaches the quorum's store: the dead member its peers' process group then waits for (a host
killed at start-up right after it asked for a quorum; benchmarks/ft_stall.py, tests/multiprocess/ft/test_ft_stall.py).

    python tests/scripts/ft_dies_in_quorum.py train --fault-tolerance ... --lighthouse HOST:PORT --replica-id c

It is dtrain's CLI with torchft's process group patched in this process only (the product holds no
hook for it); ``tests.support.procs.LaunchedJob(prefix=[python, this])`` runs it as ``this python -m dtrain ARGS``.
"""

import os
import signal
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as dtrain's __main__, before torch loads

from torchft.process_group import ProcessGroupGloo  # noqa: E402


def _die(self, *args, **kwargs):
    sys.stderr.write("ft_dies_in_quorum: in a quorum, killing this group before it reaches the store\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


ProcessGroupGloo.configure = _die

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[1:3] == ["-m", "dtrain"]:  # as LaunchedJob's prefix: PYTHON -m dtrain ARGS follow
        argv = argv[3:]
    from dtrain.cli import main

    sys.exit(main(argv))
