"""A step committed by one side only (defect B; tests/multiprocess/ft/test_ft_stall_one_sided.py):
dtrain's CLI with a fault injected in this process only (the product holds no hook for it).

    python tests/scripts/ft_one_sided.py vote-no K    PYTHON -m dtrain train --fault-tolerance ...
    python tests/scripts/ft_one_sided.py die-after K  PYTHON -m dtrain train --fault-tolerance ...
    python tests/scripts/ft_one_sided.py fail-early K PYTHON -m dtrain train --fault-tolerance ...

S is the K-th step after the first one this group tries with 2 replica groups (the same step in
both groups: they try it in the same quorum). ``vote-no``: this group's step S fails after its
all-reduce completed (as a peer's failed all-reduce would), so its vote is no while the other
group's is yes. ``die-after``: this group is killed (-9) right after it wrote step S's ledger line.
``fail-early``: this group's step S fails before its all-reduce (as one whose connection to a third
group was reset), so the other group waits in the all-reduce for its part
(tests/multiprocess/ft/test_ft_stall.py).
"""

import os
import signal
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as dtrain's __main__, before torch loads

from torchft import Manager  # noqa: E402

from dtrain.ft.ledger import FtLedger  # noqa: E402
from dtrain.ft.session import Session  # noqa: E402

MODE, K = sys.argv[1], int(sys.argv[2])
_first: list[int] = []
_done: list[int] = []  # the fault fires once: the step tried again is a step like any other
_real_vote, _real_commit, _real_allreduce = Session.should_commit, FtLedger.commit, Manager.allreduce


def _target() -> int | None:
    return _first[0] + K if _first else None


def should_commit(self, participants):
    step = self.manager.current_step() + 1
    if participants == 2 and not _first:
        _first.append(step)
    if MODE == "vote-no" and step == _target() and not _done:
        _done.append(step)
        sys.stderr.write(f"ft_one_sided: step {step}: this group's vote fails\n")
        self.manager.report_error(RuntimeError("injected: this group's step failed after its all-reduce"))
    return _real_vote(self, participants)


def commit(self, step, plan):
    _real_commit(self, step, plan)
    if MODE == "die-after" and step == _target():
        sys.stderr.write(f"ft_one_sided: step {step} committed and written; killing this group\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def allreduce(self, tensor, *args, **kwargs):
    step = self.current_step() + 1
    if self.num_participants() == 2 and not _first:
        _first.append(step)
    if MODE == "fail-early" and step == _target() and not _done:
        _done.append(step)
        sys.stderr.write(f"ft_one_sided: step {step}: this group's step fails before its all-reduce\n")
        self.report_error(RuntimeError("injected: this group's step failed before its all-reduce"))
    return _real_allreduce(self, tensor, *args, **kwargs)  # errored: torchft sends nothing


Session.should_commit, FtLedger.commit, Manager.allreduce = should_commit, commit, allreduce

if __name__ == "__main__":
    argv = sys.argv[3:]
    if argv[1:3] == ["-m", "dtrain"]:  # as LaunchedJob's prefix: PYTHON -m dtrain ARGS follow
        argv = argv[3:]
    from dtrain.cli import main

    sys.exit(main(argv))
