"""Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``, unmodified, under
``dtrain.compat.horovod`` against the same loop on dtrain's ``ddp`` (images/s per process).

    python benchmarks/horovod_synthetic.py --script PATH/pytorch_synthetic_benchmark.py -n 2 --rounds 3

Fetches nothing: PATH is a copy of Horovod's example the user has. The Horovod side runs through
the thin ``horovod`` shim of ``benchmarks/horovod_suite.py``; the ddp side is written here (same
model, batch, SGD, cross-entropy on one fixed random batch, same warm-up and timing). Sides
alternate; the ratio is of medians (and the median of each round's ratio). ``--src`` runs the
Horovod side on another dtrain source folder (e.g. an older version's) against this ddp.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_suite import SRC, write_shim  # noqa: E402

DDP_SIDE = '''import argparse, timeit, torch, torch.nn.functional as F
from torchvision import models
import dtrain
p = argparse.ArgumentParser()
p.add_argument("--model", default="resnet18"); p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--num-warmup-batches", type=int, default=10); p.add_argument("--num-batches-per-iter", type=int, default=10)
p.add_argument("--num-iters", type=int, default=10); p.add_argument("--no-cuda", action="store_true")
a = p.parse_args()
ctx = dtrain.init("ddp")
model = getattr(models, a.model)()
model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.01 * ctx.world.size))
data, target = torch.randn(a.batch_size, 3, 224, 224), torch.LongTensor(a.batch_size).random_() % 1000
def step():
    opt.zero_grad(); loss = F.cross_entropy(model(data), target); ctx.backward(loss); opt.step()
timeit.timeit(step, number=a.num_warmup_batches)
rates = [a.batch_size * a.num_batches_per_iter / timeit.timeit(step, number=a.num_batches_per_iter) for _ in range(a.num_iters)]
if ctx.world.rank == 0:
    print("Img/sec per CPU: %.1f +-0.0" % (sum(rates) / len(rates)))
ctx.close()
'''


def run(script: Path, folder: Path, n: int, extra: list[str], src: Path = SRC) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(src)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dtrain", "run", "-n", str(n), str(script), *extra]
    proc = subprocess.run(cmd, env=env, cwd=folder, capture_output=True, text=True, timeout=600)
    found = re.search(r"Img/sec per CPU: ([\d.]+)", proc.stdout)
    if not found:
        raise SystemExit(f"no images/s from {script.name}:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return float(found.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--script", required=True, type=Path, help="a copy of Horovod's pytorch_synthetic_benchmark.py")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--src", type=Path, default=SRC,
                   help="the dtrain source folder the Horovod side imports (default this checkout; e.g. another "
                        "version's src to compare; the ddp side always uses this checkout)")
    args = p.parse_args()
    extra = ["--model", "resnet18", "--batch-size", str(args.batch_size), "--num-warmup-batches", "2",
             "--num-batches-per-iter", "2", "--num-iters", str(args.iters), "--no-cuda"]
    with tempfile.TemporaryDirectory(prefix="hvd-synth-") as tmp:
        folder = Path(tmp)
        write_shim(folder)
        ddp_script = folder / "ddp_side.py"
        ddp_script.write_text(DDP_SIDE)
        hvd, ddp = [], []
        for r in range(args.rounds):
            sides = [("hvd", args.script.resolve(), hvd, args.src.resolve()), ("ddp", ddp_script, ddp, SRC)]
            for name, script, out, src in (sides if r % 2 == 0 else sides[::-1]):
                out.append(run(script, folder, args.n, extra, src))
                print(f"round {r} {name}: {out[-1]:.2f} images/s per process", flush=True)
    mh, md = statistics.median(hvd), statistics.median(ddp)
    paired = statistics.median(h / d for h, d in zip(hvd, ddp))
    print(f"median images/s per process: compat.horovod {mh:.2f}, ddp {md:.2f}; ratio {mh / md:.3f}x; "
          f"median of the rounds' ratios {paired:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
