"""Refined split (this checkout) against the first-measured split (the old code, /tmp/base/src), lm, alternating."""
import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, "/work/main/benchmarks")
import batch_split as b

args = argparse.Namespace(task="lm", steps=70, warmup=15, timeout=900)
out = open(sys.argv[1], "a")
q = b.Quota(10)
try:
    for rnd in range(int(sys.argv[2])):
        for slow in (1, 0):
            order = ["new", "old"] if (rnd + slow) % 2 == 0 else ["old", "new"]
            for side in order:
                b.ROOT = Path("/work/main") if side == "new" else Path("/tmp/base")
                l0 = b._load()
                rec = b._run(args, q, world=2, slow=slow, split="speed")
                row = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "round": rnd, "slow_rank": slow,
                       "code": side, **rec, "loadavg_before": l0, "loadavg_after": b._load()}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
finally:
    q.close()
