"""examples/fault_tolerant.py as a test runs it (``dtrain run --fault-tolerance -n 2 tests/scripts/ft_loop.py ...``):
its training set paced by PACE_FILE (seconds per sample, so a test can kill a group mid-run, then let
the job finish fast), one line per committed step in OUT (``{"replica", "time"}``), the example's
result with the replica's id as the last line of stdout.

    python tests/scripts/ft_loop.py PACE_FILE OUT --ledger DIR --epochs N --accumulate K
"""

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: examples/, tests/

from examples.fault_tolerant import digits, main  # noqa: E402
from tests.user_task import PacedDataset  # noqa: E402

from dtrain.options import FaultToleranceLink, section  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("pace_file")
parser.add_argument("out")
parser.add_argument("--ledger", default=None)
parser.add_argument("--epochs", type=int, default=60)
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()

replica = section(FaultToleranceLink).replica_id
train, test = digits()
out = open(args.out, "a", buffering=1)


def on_commit(loss: float) -> None:
    out.write(json.dumps({"replica": replica, "time": time.time(), "loss": loss}) + "\n")


result = main(PacedDataset(args.pace_file, *train.tensors), test, epochs=args.epochs, ledger=args.ledger,
              accumulate=args.accumulate, on_commit=on_commit)
print(json.dumps({**result, "replica": replica}), flush=True)
