"""Bad inputs, each tried as a hostile but fair user would: does each end with one clear line and
exit status 2, or with a traceback, a hang, or something else (accepted, wrong status, noise)?

    python benchmarks/bad_inputs.py                       # the table, on stdout
    python benchmarks/bad_inputs.py --markdown results.md # plus a per-case markdown list
    python benchmarks/bad_inputs.py -k synthetic          # only the cases whose id holds "synthetic"

A case is ``Case(id, argv=[...])`` (a ``dtrain`` command line), ``Case(id, argv=[...],
module="tests.support.netbed")``, or ``Case(id, py="...")``: a Python snippet run with ``dtrain``,
``torch``, ``nn`` imported, after ``ctx = dtrain.init("single")`` when it uses ``ctx``. A snippet's
``DtrainError`` is printed as ``dtrain: error: <message>`` with exit status 2, so both kinds are
judged alike. Every case runs in a fresh folder of fixtures (see ``make_fixtures``), as a
subprocess with a timeout. Clear = exit status 2, stderr's last non-empty line starts with
``dtrain: error:``, only one such line, and no ``Traceback`` nor C++ ``frame #`` anywhere. A case
whose right answer is not a refusal names it: ``rc=0, says="..."`` (accepted with a warning that
names the value, or a fallback such as "skipping checkpoint"), ``rc=1, says="FAIL ..."`` (a
verdict). Silent = exit 0 where a refusal or that warning was due.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import datetime
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...] | list[str] | None = None
    py: str | None = None
    module: str = "dtrain"
    owner: str = ""
    """Who fixes it when it is not this branch's part of issue 22 (e.g. "checkpoint")."""
    fast: bool = True
    """Fails in argument checking, before any worker or training starts (tests run these in-process)."""
    rc: int = 2
    """The exit status a clear answer has: 2 for a mistake refused (the default); 0 for an input
    accepted with a named warning or a fallback, 1 for a verdict (ckpt verify's FAIL)."""
    says: str | None = None
    """With ``rc``: what the output must say (e.g. "skipping checkpoint", "INVALID"); exit 0
    without it is a silent acceptance."""
    mem_gib: float | None = None
    """Address-space cap for the case (a header claiming 200 million samples must not allocate them)."""


S = ["train", "--task", "synthetic", "--task-arg", "samples=256"]  # a small, quick training job
CTX = "ctx = dtrain.init('single')\nm = nn.Linear(2, 2)\n"

CASES: list[Case] = [
    # -- from issue 22 -------------------------------------------------------------------------
    Case("train-synthetic-classes-0", ["train", "--task", "synthetic", "--task-arg", "classes=0"]),
    Case("train-synthetic-samples-0", ["train", "--task", "synthetic", "--task-arg", "samples=0"]),
    Case("train-device-tpu", ["train", "--device", "tpu"]),
    Case("api-init-device-tpu", py="dtrain.init(device='tpu:0')"),
    Case("train-metrics-file-under-file", [*S, "--metrics-file", "afile/m.jsonl"]),
    Case("bench-out-file", ["bench", "--out", "afile", "--methods", "reference", "--steps", "1"]),
    Case("submit-k8s-out-under-file", ["submit", "--k8s", "--out", "afile/x.yaml", "--", "dtrain", "train"]),
    Case("api-setup-none", py=CTX + "ctx.setup(None)"),
    Case("api-setup-str", py=CTX + "ctx.setup('x')"),
    Case("api-setup-dataloader-none", py=CTX + "ctx.setup_dataloader(None)"),
    Case("api-init-seed-str", py="dtrain.init(seed='abc')"),
    Case("train-lr-inf", [*S, "--lr", "inf"]),
    Case("train-lr-1e30", [*S, "--lr", "1e30", "--log-every", "2"], fast=False),
    Case("train-lr-1e30-n2", [*S, "-n", "2", "--lr", "1e30", "--log-every", "2"], fast=False),
    Case("train-stall-timeout-nan", [*S, "--stall-timeout", "nan"]),
    Case("train-master-addr-empty", [*S, "-n", "2", "--master-addr", ""]),
    Case("api-init-strategy-int", py="dtrain.init(strategy=123)"),
    Case("api-setup-optimizer-str", py=CTX + "ctx.setup(m, 'not an optimizer')"),
    Case("bench-timeout-0", ["bench", "--timeout", "0", "--methods", "reference", "--steps", "1"]),
    Case("submit-k8s-yaml-job", ["submit", "--k8s", "job.yaml", "--dry-run"]),
    Case("train-checkpoint-dir-file", [*S, "--checkpoint-dir", "afile"], owner="checkpoint"),
    Case("doctor-timeout-negative", ["doctor", "--timeout", "-1"]),
    Case("run-master-addr-not-a-host", ["run", "-n", "2", "--master-addr", "not a host!!", "ok.py"]),
    Case("ckpt-verify-nonexistent", ["ckpt", "verify", "/nonexistent"], owner="checkpoint"),
    # A verdict, not a refusal: verify prints FAIL and exits 1, as for every checkpoint that fails (issue 22's merge).
    Case("ckpt-verify-crafted-sharded", ["ckpt", "verify", "crafted"], owner="checkpoint", fast=False, rc=1, says="FAIL"),
    Case("ckpt-verify-random-bytes", ["ckpt", "verify", "random.bin"], owner="checkpoint"),
    # -- more: dtrain train --------------------------------------------------------------------
    Case("train-lr-nan", [*S, "--lr", "nan"]),
    Case("train-lr-negative", [*S, "--lr", "-0.1"]),
    Case("train-lr-not-a-number", [*S, "--lr", "fast"]),
    Case("train-epochs-0", [*S, "--epochs", "0"]),
    Case("train-batch-size-0", [*S, "--batch-size", "0"]),
    Case("train-batch-size-huge", [*S, "--batch-size", "100000"]),
    Case("train-grad-accum-0", [*S, "--grad-accum", "0"]),
    Case("train-accum-not-divisor", [*S, "--batch-size", "10", "--grad-accum", "3"]),
    Case("train-unknown-task", ["train", "--task", "imagenet"]),
    Case("train-unknown-strategy", [*S, "--strategy", "fdsp"]),
    Case("train-unknown-precision", [*S, "--precision", "fp8"]),
    Case("train-unknown-optimizer", [*S, "--optimizer", "lion"]),
    Case("train-task-arg-no-equals", [*S, "--task-arg", "classes"]),
    Case("train-task-arg-unknown", [*S, "--task-arg", "colour=red"]),
    Case("train-task-arg-not-int", [*S, "--task-arg", "classes=ten"]),
    Case("train-synthetic-shape-bad", ["train", "--task", "synthetic", "--task-arg", "shape=3xx"]),
    Case("train-synthetic-huge", ["train", "--task", "synthetic", "--task-arg", "samples=1000000000"]),
    Case("train-synthetic-convnet-classes", ["train", "--task", "synthetic", "--task-arg", "model=convnet", "--task-arg", "classes=12"]),
    Case("train-synthetic-layers-negative", ["train", "--task", "synthetic", "--task-arg", "layers=-1"]),
    Case("train-digits-hidden-0", ["train", "--task-arg", "hidden=0"]),
    Case("train-digits-test-fraction-nan", ["train", "--task-arg", "test_fraction=nan"]),
    Case("train-mnist-no-data-dir", ["train", "--task", "mnist"]),
    Case("train-mnist-data-dir-empty", ["train", "--task", "mnist", "--data-dir", "emptydir"]),
    Case("train-device-cuda-no-gpu", [*S, "--device", "cuda:7"]),
    Case("train-device-garbage", [*S, "--device", "gpu please"]),
    Case("train-metrics-file-is-dir", [*S, "--metrics-file", "emptydir"]),
    Case("train-nproc-0", [*S, "-n", "0"]),
    Case("train-nproc-abc", [*S, "-n", "abc"]),
    Case("train-nnodes-2-no-addr", [*S, "--nnodes", "2"]),
    Case("train-node-rank-out", [*S, "--nnodes", "2", "--node-rank", "5", "--master-addr", "127.0.0.1"]),
    Case("train-master-port-70000", [*S, "-n", "2", "--master-port", "70000"]),
    Case("train-launcher-unknown", [*S, "-n", "2", "--launcher", "mpirun"]),
    Case("train-max-restarts-neg", [*S, "--max-restarts", "-1"]),
    Case("train-stall-timeout-neg", [*S, "--stall-timeout", "-5"]),
    Case("train-stall-timeout-inf", [*S, "--stall-timeout", "inf"]),
    Case("train-run-dir-under-file", [*S, "--run-dir", "afile/run"]),
    Case("train-comm-unknown", [*S, "--comm", "zip"]),
    Case("train-comm-powersgd-rank-0", [*S, "--comm", "powersgd:0"]),
    Case("train-comm-with-fsdp", [*S, "--strategy", "fsdp", "--comm", "fp16"]),
    Case("train-comm-warmup-neg", [*S, "--comm", "fp16", "--comm-warmup", "-3"]),
    Case("train-fsdp-wrap-for-ddp", [*S, "--strategy", "ddp", "--fsdp-wrap", "size:10"]),
    Case("train-microbatches-0", [*S, "--strategy", "pipeline", "--microbatches", "0"]),
    Case("train-keep-0", [*S, "--checkpoint-dir", "ck", "--keep", "0"]),
    Case("train-save-every-no-dir", [*S, "--save-every", "5"]),
    Case("train-resume-no-dir", [*S, "--resume"]),
    Case("train-num-workers-neg", [*S, "--num-workers", "-2"]),
    Case("train-log-every-0", [*S, "--log-every", "0"]),
    Case("train-max-steps-neg", [*S, "--max-steps", "-1"]),
    Case("train-seed-overflow", [*S, "--seed", "99999999999999999999999"]),
    Case("api-init-seed-overflow", py="dtrain.init(seed=2**70)"),
    Case("train-abbreviated-flag", [*S, "--epoch", "1"]),
    Case("train-env-stall-timeout-bad", [*S, "-n", "2", "--stall-timeout", "abc"]),
    # -- user tasks (MODULE:FUNCTION) ------------------------------------------------------------
    Case("task-module-missing", ["train", "--task", "nosuchmodule:make"]),
    Case("task-function-missing", ["train", "--task", "tasks_bad:nosuch"]),
    Case("task-empty-module", ["train", "--task", ":make"]),
    Case("task-returns-none", ["train", "--task", "tasks_bad:returns_none"]),
    Case("task-returns-unknown-fields", ["train", "--task", "tasks_bad:unknown_fields"]),
    Case("task-model-not-module", ["train", "--task", "tasks_bad:model_not_module"], fast=False),
    Case("task-train-set-int", ["train", "--task", "tasks_bad:train_set_int"]),
    Case("task-lr-negative", ["train", "--task", "tasks_bad:lr_negative"]),
    Case("task-batch-size-str", ["train", "--task", "tasks_bad:batch_size_str"]),
    Case("task-loss-not-callable", ["train", "--task", "tasks_bad:loss_not_callable"]),
    Case("task-needs-argument", ["train", "--task", "tasks_bad:needs_argument"]),
    Case("task-syntax-error", ["train", "--task", "tasks_syntax:make"]),
    Case("task-not-a-function", ["train", "--task", "tasks_bad:NOT_CALLABLE"]),
    # -- dtrain run ------------------------------------------------------------------------------
    Case("run-script-missing", ["run", "-n", "2", "nosuch.py"]),
    Case("run-no-script", ["run", "-n", "2"]),
    Case("run-nproc-neg", ["run", "-n", "-1", "ok.py"]),
    Case("run-master-addr-empty", ["run", "-n", "2", "--master-addr", "", "ok.py"]),
    Case("run-stall-timeout-nan", ["run", "-n", "2", "--stall-timeout", "nan", "ok.py"]),
    Case("run-comm-bad", ["run", "-n", "2", "--comm", "powersgd:x", "ok.py"]),
    Case("run-spawn-max-restarts", ["run", "-n", "2", "--launcher", "spawn", "--max-restarts", "1", "ok.py"]),
    Case("run-script-is-dir", ["run", "-n", "2", "emptydir"]),
    # -- dtrain bench ----------------------------------------------------------------------------
    Case("bench-steps-0", ["bench", "--steps", "0"]),
    Case("bench-nproc-0", ["bench", "-n", "0"]),
    Case("bench-timeout-nan", ["bench", "--timeout", "nan", "--methods", "reference"]),
    Case("bench-timeout-neg", ["bench", "--timeout", "-3", "--methods", "reference"]),
    Case("bench-methods-unknown", ["bench", "--methods", "ddp,warp"]),
    Case("bench-batch-size-0", ["bench", "--batch-size", "0", "--methods", "reference"]),
    Case("bench-device-tpu", ["bench", "--device", "tpu", "--methods", "reference"]),
    Case("bench-out-under-file", ["bench", "--out", "afile/sub", "--methods", "reference"]),
    Case("bench-warmup-neg", ["bench", "--warmup", "-1"]),
    Case("bench-threads-0", ["bench", "--threads", "0"]),
    Case("bench-synthetic-classes-0", ["bench", "--task", "synthetic", "--task-arg", "classes=0"]),
    # -- dtrain submit ---------------------------------------------------------------------------
    Case("submit-slurm-out-under-file", ["submit", "--slurm", "--dry-run", "--out", "afile/x.sbatch", "--", "dtrain", "train"]),
    Case("submit-no-target", ["submit", "--dry-run", "--", "dtrain", "train"]),
    Case("submit-both-targets", ["submit", "--slurm", "--k8s", "--", "dtrain", "train"]),
    Case("submit-job-missing", ["submit", "--k8s", "nosuch.toml", "--dry-run"]),
    Case("submit-job-invalid-toml", ["submit", "--k8s", "bad.toml", "--dry-run"]),
    Case("submit-job-unknown-key", ["submit", "--k8s", "unknown_key.toml", "--dry-run"]),
    Case("submit-job-is-dir", ["submit", "--k8s", "dir.toml", "--dry-run"]),
    Case("submit-nodes-0", ["submit", "--k8s", "--dry-run", "--nodes", "0", "--", "dtrain", "train"]),
    Case("submit-time-bad", ["submit", "--slurm", "--dry-run", "--time", "forever", "--", "dtrain", "train"]),
    Case("submit-mem-bad", ["submit", "--slurm", "--dry-run", "--mem-per-proc", "lots", "--", "dtrain", "train"]),
    Case("submit-env-no-equals", ["submit", "--k8s", "--dry-run", "--env", "FOO", "--", "dtrain", "train"]),
    Case("submit-layout-bad", ["submit", "--k8s", "--dry-run", "--layout", "torus", "--", "dtrain", "train"]),
    Case("submit-no-command", ["submit", "--k8s", "--dry-run"]),
    Case("submit-out-is-dir", ["submit", "--k8s", "--out", "emptydir", "--", "dtrain", "train"]),
    # -- dtrain doctor ---------------------------------------------------------------------------
    Case("doctor-timeout-nan", ["doctor", "--timeout", "nan"]),
    Case("doctor-timeout-0", ["doctor", "--timeout", "0"]),
    Case("doctor-node-rank-out", ["doctor", "--nnodes", "2", "--node-rank", "2"]),
    Case("doctor-nnodes-no-addr", ["doctor", "--nnodes", "2", "--node-rank", "1"]),
    Case("doctor-master-port-bad", ["doctor", "--master-port", "99999"]),
    Case("doctor-master-addr-bad", ["doctor", "--master-addr", "not a host!!", "--no-probe"]),
    # -- dtrain ckpt -----------------------------------------------------------------------------
    Case("ckpt-ls-missing", ["ckpt", "ls", "/nonexistent"], owner="checkpoint"),
    Case("ckpt-ls-file", ["ckpt", "ls", "afile"], owner="checkpoint"),
    Case("ckpt-verify-empty-dir", ["ckpt", "verify", "emptydir"], owner="checkpoint"),
    Case("ckpt-diff-missing", ["ckpt", "diff", "/nonexistent", "/nonexistent2"], owner="checkpoint"),
    Case("ckpt-consolidate-missing", ["ckpt", "consolidate", "/nonexistent", "out.pt"], owner="checkpoint"),
    Case("ckpt-no-subcommand", ["ckpt"]),
    Case("unknown-subcommand", ["trian"]),
    # -- netbed ----------------------------------------------------------------------------------
    Case("netbed-rate-negative", ["--rate-mbit", "-5", "--check"], module="tests.support.netbed"),
    Case("netbed-delay-nan", ["--delay-ms", "nan", "--check"], module="tests.support.netbed"),
    Case("netbed-timeout-0", ["--timeout", "0", "--", "true"], module="tests.support.netbed"),
    Case("netbed-unknown-flag", ["--rate", "5"], module="tests.support.netbed"),
    # -- the public API --------------------------------------------------------------------------
    Case("api-init-precision-int", py="dtrain.init(precision=16)"),
    Case("api-init-precision-unknown", py="dtrain.init(precision='fp4')"),
    Case("api-init-strategy-unknown", py="dtrain.init(strategy='fdsp')"),
    Case("api-init-seed-float", py="dtrain.init(seed=1.5)"),
    Case("api-init-timeout-neg", py="dtrain.init(timeout_s=-1)"),
    Case("api-init-stall-nan", py="dtrain.init(stall_timeout=float('nan'))"),
    Case("api-init-device-cuda-9", py="dtrain.init(device='cuda:9')"),
    Case("api-init-device-int", py="dtrain.init(device=3.5)"),
    Case("api-init-world-str", py="dtrain.init(world='big')"),
    Case("api-init-comm-bad", py="dtrain.init(comm='gzip')"),
    Case("api-init-unknown-option", py="dtrain.init(strategy='ddp', bucket_cap=5)"),
    Case("api-init-env-stall-bad", py="import os\nos.environ['DTRAIN_STALL_TIMEOUT'] = 'soon'\ndtrain.init()"),
    Case("api-setup-twice", py=CTX + "w = ctx.setup(m)\nctx.setup(w)"),
    Case("api-setup-optimizer-twice", py=CTX + "o = torch.optim.SGD(m.parameters(), lr=0.1)\nw, o2 = ctx.setup(m, o)\nctx.setup(nn.Linear(2, 2), o2)"),
    Case("api-setup-dataloader-dataset", py=CTX + "ctx.setup_dataloader(torch.utils.data.TensorDataset(torch.ones(4, 2)))"),
    Case("api-accumulate-steps-0", py=CTX + "w = ctx.setup(m)\nwith ctx.accumulate(w, steps=0):\n    pass"),
    Case("api-accumulate-steps-float", py=CTX + "w = ctx.setup(m)\nwith ctx.accumulate(w, steps=2.5):\n    pass"),
    Case("api-all-reduce-float", py=CTX + "ctx.all_reduce(1.0)"),
    Case("api-all-reduce-op", py=CTX + "ctx.all_reduce(torch.ones(1), op='avg')"),
    Case("api-broadcast-src-out", py=CTX + "ctx.broadcast(torch.ones(1), src=4)"),
    Case("api-gather-dst-neg", py=CTX + "ctx.gather_object(1, dst=-1)"),
    Case("api-clip-nan", py=CTX + "w = ctx.setup(m)\nctx.clip_grad_norm_(w, float('nan'))"),
    Case("api-evaluate-batch-0", py=CTX + "ds = torch.utils.data.TensorDataset(torch.ones(4, 2), torch.zeros(4, dtype=torch.long))\nctx.evaluate(ctx.setup(m), ds, dtrain.tasks.accuracy, batch_size=0)"),
    Case("api-evaluate-dataset-none", py=CTX + "ctx.evaluate(ctx.setup(m), None, dtrain.tasks.accuracy)"),
    Case("api-checkpoints-under-file", py=CTX + "ctx.checkpoints('afile/ck')"),
    Case("api-checkpoints-keep-0", py=CTX + "ctx.checkpoints('ck', keep=0)"),
    Case("api-save-state-list", py=CTX + "ctx.save('x.pt', [m])"),
    Case("api-load-missing", py=CTX + "ctx.load('/nonexistent.pt', {'model': m})", owner="checkpoint"),
    Case("api-task-lr-negative", py="dtrain.Task(name='t', build_model=lambda: nn.Linear(2, 2), train_set=[(1, 2)], lr=-1)"),
    Case("api-task-train-set-none", py="dtrain.Task(name='t', build_model=lambda: nn.Linear(2, 2), train_set=None)"),
    Case("api-precision-resolve-bad", py="dtrain.Precision.resolve('fp3', torch.device('cpu'))"),
    Case("api-seed-everything-str", py="dtrain.seed_everything('x')"),
    Case("api-hvd-optimizer-str", py="import dtrain.compat.horovod as hvd\nhvd.init()\nhvd.DistributedOptimizer('sgd')"),
    Case("api-hvd-broadcast-root-out", py="import dtrain.compat.horovod as hvd\nhvd.init()\nhvd.broadcast(torch.ones(1), root_rank=3)"),
    Case("api-hvd-allreduce-float", py="import dtrain.compat.horovod as hvd\nhvd.init()\nhvd.allreduce(1.0)"),
    Case("api-hvd-compression-bad", py="import dtrain.compat.horovod as hvd\nhvd.init()\nhvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), compression='zip')"),
    Case("api-apex-opt-level", py="from dtrain.compat.apex import amp\namp.initialize(nn.Linear(2, 2), opt_level='O9')"),
    Case("api-apex-models-none", py="from dtrain.compat.apex import amp\namp.initialize(None, opt_level='O1')"),
    Case("api-apex-optimizer-str", py="from dtrain.compat.apex import amp\namp.initialize(nn.Linear(2, 2), 'adam', opt_level='O1')"),
    Case("api-apex-ddp-none", py="from dtrain.compat.apex.parallel import DistributedDataParallel\nDistributedDataParallel(None)"),
    Case("api-world-rank-out", py="dtrain.World(rank=3, size=2)"),
]


RESUME_PAST_FUNCTION = """
import os, sys
from dtrain.cli import main
from dtrain.checkpoint.store import write_checkpoint
base = ["train", "--task", "synthetic", "--task-arg", "samples=64", "--batch-size", "16", "--checkpoint-dir", "ck"]
assert main([*base, "--max-steps", "2", "--save-every", "1"]) == 0
state = torch.load("ck/step-00000002/state.pt", weights_only=True)
state["extra"]["hook"] = os.getcwd  # a function: loading refuses it
write_checkpoint("ck", 2, {"state.pt": state}, {"world_size": 1})
sys.exit(main([*base, "--max-steps", "4", "--resume"]))
"""

# -- issue 32: the flags and commands added since issue 22's pass ----------------------------------
E = [*S, "--nnodes", "1:2", "--master-addr", "127.0.0.1", "--checkpoint-dir", "ck"]  # an elastic job on one node
T = [*S, "--max-steps", "3", "--log-every", "1"]  # three steps
NEW_FLAG_CASES = [
    # output paths: refused at start, not after training started
    Case("train-ledger-proc", [*S, "--ledger", "/proc/dtrain-ledger"]),
    Case("train-ledger-under-file", [*S, "--ledger", "afile/ledger"]),
    Case("train-ledger-is-file", [*S, "--ledger", "afile"]),
    Case("train-ledger-empty", [*S, "--ledger", ""]),
    Case("train-tensorboard-proc", [*S, "--tensorboard", "/proc/dtrain-tb"]),
    Case("train-tensorboard-under-file", [*S, "--tensorboard", "afile/tb"]),
    Case("train-tensorboard-is-file", [*S, "--tensorboard", "afile"]),
    Case("train-trace-file-proc", [*S, "--trace", "1:2", "--trace-file", "/proc/dtrain-trace.json"]),
    Case("train-trace-file-under-file", [*S, "--trace", "1:2", "--trace-file", "afile/t.json"]),
    Case("train-trace-file-is-dir", [*S, "--trace", "1:2", "--trace-file", "emptydir"]),
    Case("train-trace-file-empty", [*S, "--trace", "1:2", "--trace-file", ""]),
    Case("train-metrics-file-proc", [*S, "--metrics-file", "/proc/dtrain-m.jsonl"]),
    Case("train-checkpoint-dir-proc", [*S, "--checkpoint-dir", "/proc/dtrain-ck"]),
    Case("train-run-dir-proc", [*S, "--run-dir", "/proc/dtrain-run"]),
    Case("run-run-dir-proc", ["run", "-n", "2", "--run-dir", "/proc/dtrain-run", "ok.py"]),
    Case("report-out-under-file", ["report", "run_ok", "--out", "afile/rep"]),
    Case("report-out-proc", ["report", "run_ok", "--out", "/proc/dtrain-rep"]),
    Case("ckpt-consolidate-out-under-file", ["ckpt", "consolidate", "funcck/step-00000001", "afile/x.pt"], owner="checkpoint"),
    # values that switch a feature off: refused, or named in a warning
    Case("train-straggler-threshold-inf", [*S, "--straggler-threshold", "inf"]),
    Case("train-straggler-threshold-nan", [*S, "--straggler-threshold", "nan"]),
    Case("train-straggler-threshold-1", [*S, "--straggler-threshold", "1"]),
    Case("train-straggler-threshold-neg", [*S, "--straggler-threshold", "-2"]),
    Case("train-straggler-threshold-word", [*S, "--straggler-threshold", "high"]),
    Case("train-straggler-window-0", [*S, "--straggler-window", "0"]),
    Case("train-straggler-window-neg", [*S, "--straggler-window", "-5"]),
    Case("train-straggler-window-float", [*S, "--straggler-window", "2.5"]),
    Case("train-straggler-window-no-breakdown", [*S, "--no-breakdown", "--straggler-window", "5"]),
    Case("train-straggler-threshold-no-breakdown", [*S, "--no-breakdown", "--straggler-threshold", "2"]),
    Case("train-trace-file-without-trace", [*S, "--trace-file", "t.json"]),
    Case("train-trace-no-breakdown", [*S, "--trace", "1:2", "--no-breakdown"]),
    Case("train-trace-word", [*S, "--trace", "abc"]),
    Case("train-trace-reversed", [*S, "--trace", "5:2"]),
    Case("train-trace-start-0", [*S, "--trace", "0:3"]),
    Case("train-trace-empty-range", [*S, "--trace", "3:3"]),
    Case("train-trace-float", [*S, "--trace", "1.5:3"]),
    Case("train-trace-three-parts", [*S, "--trace", "1:2:3"]),
    Case("train-trace-past-max-steps", [*T, "--trace", "5:7"]),
    Case("train-trace-past-run", [*S, "--batch-size", "64", "--epochs", "1", "--trace", "50:60"], fast=False),
    Case("train-trace-ends-inside", [*T, "--trace", "2:100"], fast=False, rc=0, says="the trace holds steps 2 to 3"),
    # elastic flags
    Case("train-rdzv-last-call-nan", [*E, "--rdzv-last-call", "nan"]),
    Case("train-rdzv-last-call-inf", [*E, "--rdzv-last-call", "inf"]),
    Case("train-rdzv-last-call-neg", [*E, "--rdzv-last-call", "-1"]),
    Case("train-rdzv-timeout-0", [*E, "--rdzv-timeout", "0"]),
    Case("train-rdzv-timeout-nan", [*E, "--rdzv-timeout", "nan"]),
    Case("train-rdzv-timeout-word", [*E, "--rdzv-timeout", "soon"]),
    Case("train-nnodes-reversed", [*S, "--nnodes", "3:1", "--master-addr", "127.0.0.1", "--checkpoint-dir", "ck"]),
    Case("train-nnodes-min-0", [*S, "--nnodes", "0:2", "--master-addr", "127.0.0.1", "--checkpoint-dir", "ck"]),
    Case("train-nnodes-words", [*S, "--nnodes", "a:b"]),
    Case("train-nnodes-three-parts", [*S, "--nnodes", "1:2:3"]),
    Case("train-nnodes-elastic-no-checkpoint-dir", [*S, "--nnodes", "1:2", "--master-addr", "127.0.0.1"]),
    Case("train-nnodes-elastic-no-master-addr", [*S, "--nnodes", "1:2", "--checkpoint-dir", "ck"]),
    Case("train-nnodes-elastic-spawn", [*E, "--launcher", "spawn"]),
    Case("train-elastic-batch-global-fixed-size", [*S, "--elastic-batch", "global"]),
    Case("train-elastic-batch-unknown", [*S, "--elastic-batch", "local"]),
    Case("run-rdzv-last-call-nan", ["run", "--nnodes", "1:2", "--master-addr", "127.0.0.1", "--rdzv-last-call", "nan", "ok.py"]),
    # --parallel
    Case("train-parallel-repeated", [*S, "--parallel", "tp=2,tp=1"]),
    Case("train-parallel-repeated-same", [*S, "-n", "2", "--parallel", "dp_shard=2,dp_shard=2"]),
    Case("train-parallel-unknown-name", [*S, "--parallel", "ep=2"]),
    Case("train-parallel-zero", [*S, "--parallel", "tp=0"]),
    Case("train-parallel-negative", [*S, "-n", "2", "--parallel", "tp=-2"]),
    Case("train-parallel-empty", [*S, "--parallel", ""]),
    Case("train-parallel-not-number", [*S, "--parallel", "tp=two"]),
    Case("train-parallel-product", [*S, "-n", "2", "--parallel", "tp=4"]),
    Case("train-parallel-and-strategy", [*S, "-n", "2", "--strategy", "fsdp", "--parallel", "dp_shard=2"]),
    Case("run-parallel-repeated", ["run", "-n", "2", "--parallel", "tp=2,tp=1", "ok.py"]),
    Case("bench-parallel-repeated", ["bench", "--methods", "reference", "--parallel", "pp=2,pp=2"]),
    # dtrain bench --comm, dtrain plan --margin (the plan's close calls)
    Case("bench-comm-none", ["bench", "--methods", "ddp", "--comm", "none"]),
    Case("bench-comm-auto", ["bench", "--methods", "ddp", "--comm", "auto"]),
    Case("bench-comm-unknown", ["bench", "--methods", "ddp", "--comm", "zip"]),
    Case("bench-comm-repeated", ["bench", "--methods", "ddp", "--comm", "bf16", "--comm", "bf16"]),
    Case("bench-comm-powersgd-warmup", ["bench", "--methods", "ddp", "--warmup", "1", "--comm", "powersgd:2"]),
    Case("plan-margin-negative", ["plan", "--margin", "-5"]),
    Case("plan-margin-whole", ["plan", "--margin", "100"]),
    Case("plan-margin-nan", ["plan", "--margin", "nan"]),
    Case("api-init-parallel-unknown", py="dtrain.init(parallel={'ep': 2})"),
    Case("api-init-parallel-repeated", py="dtrain.init(parallel='tp=1,tp=1')"),
    # dtrain ckpt ledger
    Case("ckpt-ledger-missing", ["ckpt", "ledger", "/nonexistent"]),
    Case("ckpt-ledger-file", ["ckpt", "ledger", "afile"]),
    Case("ckpt-ledger-no-files", ["ckpt", "ledger", "emptydir"]),
    Case("ckpt-ledger-binary", ["ckpt", "ledger", "ledger_binary"]),
    Case("ckpt-ledger-wrong-types", ["ckpt", "ledger", "ledger_types"]),
    Case("ckpt-ledger-header-begin-word", ["ckpt", "ledger", "ledger_header"]),
    Case("ckpt-ledger-string-steps", ["ckpt", "ledger", "ledger_strings"]),
    Case("ckpt-ledger-not-records", ["ckpt", "ledger", "ledger_lists"]),
    Case("ckpt-ledger-index-out-of-range", ["ckpt", "ledger", "ledger_range"]),
    Case("ckpt-ledger-file-is-dir", ["ckpt", "ledger", "ledger_dirfile"]),
    Case("ckpt-ledger-200-million", ["ckpt", "ledger", "ledger_huge"], rc=0, says="199999998", mem_gib=4),
    # dtrain report
    Case("report-missing", ["report", "/nonexistent"]),
    Case("report-file", ["report", "afile"]),
    Case("report-empty-dir", ["report", "emptydir"]),
    Case("report-binary", ["report", "run_binary"]),
    Case("report-step-string", ["report", "run_strings"]),
    Case("report-metrics-is-dir", ["report", "run_dir_metrics"]),
    Case("report-result-not-object", ["report", "run_result_list"], rc=0, says="is not a result record"),
    Case("report-fields-wrong-types", ["report", "run_fields"], rc=0, says="of the wrong type"),
    Case("report-trace-garbage", ["report", "run_trace"], rc=0, says="not a dtrain trace"),
    # dtrain run --local-rank-arg
    Case("run-local-rank-arg-takes-script", ["run", "-n", "2", "--local-rank-arg", "plain.py", "-a", "x"]),
    Case("run-local-rank-arg-word", ["run", "-n", "2", "--local-rank-arg=local_rank", "plain.py"]),
    Case("run-local-rank-arg-single-dash", ["run", "-n", "2", "--local-rank-arg=-l", "plain.py"]),
    Case("run-local-rank-arg-flag-spaced", ["run", "-n", "2", "--local-rank-arg", "--local_rank", "plain.py"]),
    Case("run-local-rank-arg-none-required", ["run", "-n", "2", "--local-rank-arg", "none", "needs_lr.py"], fast=False),
    # checkpoints that pickle a function: judged as loading judges them; everything falls back past them
    Case("ckpt-verify-function-state", ["ckpt", "verify", "funcck"], owner="checkpoint", rc=1, says="FAIL funcck/step-00000002"),
    Case("ckpt-ls-function-state", ["ckpt", "ls", "funcck"], owner="checkpoint", rc=0, says="INVALID"),
    Case("ckpt-verify-function-file", ["ckpt", "verify", "func.pt"], owner="checkpoint", rc=1, says="FAIL func.pt"),
    Case("ckpt-diff-function-falls-back", ["ckpt", "diff", "funcck", "funcck/step-00000001"], owner="checkpoint", rc=0,
         says="skipping checkpoint"),
    Case("ckpt-consolidate-function-falls-back", ["ckpt", "consolidate", "funcck", "out.pt"], owner="checkpoint", rc=0,
         says="skipping checkpoint"),
    Case("ckpt-diff-function-named", ["ckpt", "diff", "funcck/step-00000002", "funcck/step-00000001"], owner="checkpoint"),
    Case("ckpt-consolidate-entry-unknown", ["ckpt", "consolidate", "funcck/step-00000001", "out.pt", "--entry", "nope"], owner="checkpoint"),
    Case("train-resume-function-falls-back", py=RESUME_PAST_FUNCTION, owner="checkpoint", fast=False, rc=0,
         says="resumed from ck/step-00000001"),
    # other flags added since
    Case("train-activation-checkpointing-no-blocks", [*S, "--activation-checkpointing"]),
    Case("train-compile-and-ac-no-blocks", [*S, "--compile", "--activation-checkpointing"]),
    Case("train-sync-bn-no-batchnorm", [*S, "-n", "2", "--sync-bn"], fast=False, rc=0, says="--sync-bn: the model has no BatchNorm"),
    Case("train-sync-bn-one-process", [*S, "--task-arg", "model=convnet", "--sync-bn", "--max-steps", "2"], fast=False, rc=0,
         says="--sync-bn"),
    Case("train-channels-last-mlp", [*S, "--channels-last", "--max-steps", "2"], fast=False, rc=0, says="--channels-last: the model has no 4-D"),
    Case("train-channels-last-fsdp", [*S, "-n", "2", "--strategy", "fsdp", "--channels-last"]),
    Case("train-async-save-keep-0", [*S, "--checkpoint-dir", "ck", "--async-save", "--keep", "0"]),
    Case("train-async-save-no-dir", [*S, "--async-save"]),
    Case("train-stall-timeout-word", [*S, "--stall-timeout", "soon"]),
]
# -- issue 51: the classes tried again (restart, start-up waits, sbatch/k8s values, the plan's figures, the API) ------
P = ["plan", "--device", "h100", "-n", "8"]
_LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
_LINKS_NEG = ('{"between": "nodes", "ranks": 2, "backend": "gloo", "load": 0.5, "seconds": {'
              + ", ".join(f'"{k}": {{"64": {-1e-3 if k == "all_reduce" else 1e-3}, "1048576": 0.05, "4194304": 0.2}}' for k in _LINK_KINDS)
              + "}}")


def job_file(toml: str) -> str:
    """A snippet that loads ``toml`` as a dtrain submit job file."""
    return f"import dtrain.launch.jobspec as js\nopen('j.toml', 'w').write({toml!r})\njs.load('j.toml')"


JOB = 'command = ["train.py"]\n'
ISSUE51_CASES = [
    # start-up waits and their bound
    Case("run-startup-timeout-tiny", ["run", "-n", "2", "--startup-timeout", "1e-9", "ok.py"]),
    Case("train-startup-timeout-tiny", [*S, "-n", "2", "--startup-timeout", "1e-9"]),
    Case("train-startup-timeout-half", [*S, "-n", "2", "--startup-timeout", "0.5"]),
    Case("train-startup-timeout-nan", [*S, "-n", "2", "--startup-timeout", "nan"]),
    Case("train-startup-timeout-inf", [*S, "-n", "2", "--startup-timeout", "inf"]),
    Case("train-rdzv-timeout-half", [*E, "--rdzv-timeout", "0.5"]),
    Case("api-env-startup-timeout-tiny", py="import os\nos.environ['DTRAIN_STARTUP_TIMEOUT'] = '1e-9'\ndtrain.init('single')"),
    Case("run-local-addr-wildcard", ["run", "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--local-addr", "0.0.0.0", "ok.py"]),
    Case("train-local-addr-wildcard-elastic", [*E, "--local-addr", "::"]),
    Case("run-node-1-without-node-0", ["run", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                       "--master-port", "29681", "--startup-timeout", "3", "ok.py"],
         fast=False, rc=1, says="node 1 could not connect to node 0 at 127.0.0.1:29681 within 3 s"),
    Case("train-node-0-without-node-1", [*S, "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29682",
                                         "--startup-timeout", "3"], fast=False, rc=1, says="node 0 waited 3 s at 127.0.0.1:29682 for node(s) 1 of --nnodes 2"),
    Case("train-elastic-below-min-nodes", [*S, "-n", "1", "--nnodes", "2:3", "--master-addr", "127.0.0.1", "--master-port", "29683",
                                           "--checkpoint-dir", "ck", "--startup-timeout", "3"], fast=False, rc=1, says="and no round formed with it"),
    # values that reach an sbatch script or a Kubernetes manifest
    Case("submit-partition-newline", ["submit", "--slurm", "--dry-run", "--partition", "gpu\ntouch INJECTED", "--", "train.py"]),
    Case("submit-partition-semicolon", ["submit", "--slurm", "--dry-run", "--partition", "gpu;touch INJECTED", "--", "train.py"]),
    Case("submit-name-trailing-newline", ["submit", "--slurm", "--dry-run", "--name", "mnist\n", "--", "train.py"]),
    Case("submit-time-trailing-newline", ["submit", "--slurm", "--dry-run", "--time", "10\n", "--", "train.py"]),
    Case("submit-env-key-newline", ["submit", "--slurm", "--dry-run", "--env", "A\nB=1", "--", "train.py"]),
    Case("submit-command-newline", ["submit", "--slurm", "--dry-run", "--", "train.py", "a\ntouch INJECTED"]),
    Case("submit-dtrain-cmd-unclosed-quote", ["submit", "--slurm", "--dry-run", "--dtrain-cmd", "python3 '-m dtrain", "--", "train.py"]),
    Case("submit-k8s-image-space", ["submit", "--k8s", "--dry-run", "--image", "me/x:1 --privileged", "--", "train.py"]),
    Case("submit-job-name-int", py=job_file('name = 5\ncommand = ["train.py"]\n')),
    Case("submit-job-command-int", py=job_file("command = 5\n")),
    Case("submit-job-command-unclosed-quote", py=job_file("command = \"train.py 'x\"\n")),
    Case("submit-job-requeue-str", py=job_file(JOB + '[slurm]\nrequeue = "no"\n')),
    Case("submit-job-gpus-bool", py=job_file(JOB + "gpus_per_node = true\n")),
    Case("submit-job-signal-negative", py=job_file(JOB + "[slurm]\nsignal_before_s = -90\n")),
    Case("submit-job-account-injection", py=job_file(JOB + '[slurm]\naccount = "$(touch INJECTED)"\n')),
    Case("submit-job-output-newline", py=job_file(JOB + '[slurm]\noutput = "x\\ntouch INJECTED"\n')),
    Case("submit-job-extra-not-option", py=job_file(JOB + '[slurm]\nextra = ["exclusive"]\n')),
    Case("submit-job-workdir-newline", py=job_file(JOB + 'workdir = "/a\\ntouch INJECTED"\n')),
    Case("submit-job-env-bool", py=job_file(JOB + "[env]\nA = true\n")),
    Case("submit-job-time-unquoted", py=job_file(JOB + "time = 02:00:00\n")),
    Case("submit-job-k8s-port-negative", py=job_file(JOB + "[k8s]\nport = -1\n")),
    Case("submit-job-k8s-port-str", py=job_file(JOB + '[k8s]\nport = "29500"\n')),
    Case("submit-job-k8s-namespace-bad", py=job_file(JOB + '[k8s]\nnamespace = "My Team"\n')),
    Case("submit-job-k8s-pull-policy-bad", py=job_file(JOB + '[k8s]\nimage_pull_policy = "always"\n')),
    Case("submit-job-slurm-not-table", py=job_file(JOB + "slurm = 5\n")),
    # the plan's figures and files
    Case("plan-latency-negative", [*P, "--intra-latency-us", "-5"]),
    Case("plan-latency-zero", [*P, "--nnodes", "2", "--inter-latency-us", "0"]),
    Case("plan-bandwidth-nan", [*P, "--inter-gbit", "nan"]),
    Case("plan-bandwidth-zero", [*P, "--intra-gbit", "0"]),
    Case("plan-peak-inf", [*P, "--peak-tflops", "inf"]),
    Case("plan-peak-zero", [*P, "--peak-tflops", "0"]),
    Case("plan-mem-negative", [*P, "--mem-gib", "-1"]),
    Case("plan-mfu-subnormal", [*P, "--mfu", "1e-320"]),
    Case("plan-nproc-billion", ["plan", "--device", "h100", "-n", "1000000000"], mem_gib=8),
    Case("plan-nnodes-billion", [*P, "--nnodes", "1000000000"], mem_gib=8),
    Case("plan-batch-ten-billion", [*P, "--batch-size", "10000000000"], mem_gib=8),
    Case("plan-cluster-binary", ["plan", "--cluster", "random.bin"]),
    Case("plan-cluster-folder", ["plan", "--cluster", "emptydir"]),
    Case("plan-cluster-dev-zero", ["plan", "--cluster", "/dev/zero"]),
    Case("plan-cluster-fifo", ["plan", "--cluster", "fifo"]),
    Case("plan-cluster-latency-negative", ["plan", "--cluster", "neg.json"]),
    Case("plan-links-binary", ["plan", "--links", "random.bin"]),
    Case("plan-links-folder", ["plan", "--links", "emptydir"]),
    Case("plan-links-fifo", ["plan", "--links", "fifo"]),
    Case("plan-links-time-negative", ["plan", "--links", "l_neg.json"]),
    Case("plan-chart-under-file", [*P, "--chart", "afile/plan.png"]),
    Case("plan-chart-format", [*P, "--chart", "plan.xyz"]),
    Case("doctor-links-out-under-file", ["doctor", "--links-out", "afile/links.json"]),
    # the API, and small ones
    Case("api-init-unknown-option-single", py="dtrain.init(bogus_option=1)"),
    Case("api-init-compile-str", py="dtrain.init(compile='no')"),
    Case("api-init-activation-checkpointing-str", py="dtrain.init(activation_checkpointing='off')"),
    Case("api-checkpoints-async-save-str", py=CTX + "ctx.checkpoints('ck', async_save='no')"),
    Case("api-call-after-close", py=CTX + "ctx.close()\nctx.barrier()"),
    Case("api-save-onto-folder", py=CTX + "ctx.save('emptydir', {'model': m})"),
    Case("train-warmup-steps-over-run", [*S, "--max-steps", "3", "--warmup-steps", "100"], fast=False, rc=0,
         says="--warmup-steps 100 is more than half of this run's 3 steps"),
    # dtrain dry-run (new with issue 53)
    Case("dryrun-rank-outside", ["dry-run", "--task", "lm", "-n", "4", "--rank", "4"]),
    Case("dryrun-steps-0", ["dry-run", "--task", "lm", "--steps", "0"]),
    Case("dryrun-nnodes-elastic", ["dry-run", "--task", "lm", "--nnodes", "1:4"]),
    Case("dryrun-device-memory-nan", ["dry-run", "--task", "lm", "--device-memory", "nan"]),
    Case("dryrun-parallel-auto", ["dry-run", "--task", "lm", "-n", "4", "--parallel", "auto"]),
    Case("dryrun-pp", ["dry-run", "--task", "lm", "-n", "4", "--parallel", "pp=2,dp_shard=2"]),
    Case("dryrun-layout-world", ["dry-run", "--task", "lm", "-n", "4", "--parallel", "dp_shard=3"]),
    Case("dryrun-heads-tp", ["dry-run", "--task", "lm", "-n", "4", "--parallel", "tp=4", "--task-arg", "heads=6",
                             "--task-arg", "width=48"], fast=False),
    Case("dryrun-empty-rank", ["dry-run", "--task", "lm", "--task-arg", "width=32", "--task-arg", "heads=2", "--task-arg", "layers=1",
                               "--task-arg", "context=16", "-n", "512", "--strategy", "fsdp", "--rank", "300", "--device", "cpu"], fast=False),
    Case("dryrun-does-not-fit", ["dry-run", "--task", "lm", "-n", "2", "--strategy", "fsdp", "--device", "cpu", "--device-memory",
                                 "0.000001"], fast=False, rc=1, says="does NOT fit"),
    Case("lm-vocab-small", ["dry-run", "--task", "lm", "--task-arg", "vocab=100"]),
    # FSDP's reduce dtype and float8 (new with issue 53)
    Case("train-fsdp-reduce-int8", [*S, "--strategy", "fsdp", "--fsdp-reduce", "int8"]),
    Case("train-fsdp-reduce-for-ddp", [*S, "--strategy", "ddp", "--fsdp-reduce", "bf16"]),
    Case("train-float8-on-cpu", [*S, "--precision", "float8", "--device", "cpu"]),
    Case("train-float8-recipe-bad", [*S, "--precision", "float8", "--float8-recipe", "colwise"]),
    Case("train-float8-emulate-without-float8", [*S, "--float8-emulate"]),
    Case("api-init-float8-cpu", py="dtrain.init(precision='float8', device='cpu')"),
    Case("api-fsdp-reduce-bad", py="dtrain.init('fsdp', reduce_dtype='int8')"),
]
"""Issue 51's classes (and the dry run's inputs); ``--set issue51``. The 2-rank call after ``close()`` is
tests/multiprocess/context/test_misuse.py's (a one-process snippet cannot show it)."""

FT = ["train", "--fault-tolerance", "--max-steps", "2"]  # a fault-tolerant job that would stop at once
LATEST_CASES = [
    # dtrain plan: float8 and the FSDP reduce dtype (issue 53)
    Case("plan-float8-a100", ["plan", "--task", "lm", "--device", "a100", "--precision", "float8"]),
    Case("plan-float8-cpu", ["plan", "--task", "lm", "--precision", "float8"]),
    Case("plan-fsdp-reduce-bf32", ["plan", "--task", "lm", "-n", "2", "--fsdp-reduce", "bf32"]),
    # --micro-batch auto (issue 54, item 2)
    Case("train-micro-batch-number", [*S, "--micro-batch", "8"]),
    Case("train-micro-batch-auto-grad-accum", [*S, "--micro-batch", "auto", "--grad-accum", "2"]),
    Case("train-micro-batch-auto-fsdp", [*S, "--micro-batch", "auto", "--strategy", "fsdp"]),
    Case("train-micro-batch-auto-dp-shard", [*S, "--micro-batch", "auto", "--parallel", "dp_shard=2"]),
    Case("train-micro-batch-auto-too-big", [*S, "--micro-batch", "auto", "--task-arg", "hidden=60000"], fast=False),
    Case("train-micro-batch-auto-elastic-global", [*S, "--micro-batch", "auto", "--nnodes", "1:2", "--master-addr",
                                                   "127.0.0.1", "--elastic-batch", "global", "--checkpoint-dir", "ck"]),
    Case("api-oom-inject-malformed", py="import os\nos.environ['DTRAIN_OOM_INJECT'] = '1:64XB'\ndtrain.init('single')"),
    Case("api-oom-inject-bad-step", py="import os\nos.environ['DTRAIN_OOM_INJECT'] = '1:64MiB@x'\ndtrain.init('single')"),
    Case("train-micro-batch-auto-comm", [*S, "-n", "2", "--micro-batch", "auto", "--comm", "powersgd"]),
    # --batch-split (issue 54, item 1)
    Case("train-batch-split-zero-share", ["train", "--batch-split", "64,0"]),
    Case("train-batch-split-unknown", ["train", "--batch-split", "fast"]),
    Case("train-batch-split-micro-auto", ["train", "--micro-batch", "auto", "--batch-split", "speed"]),
    Case("train-batch-split-count", ["train", "-n", "2", "--max-steps", "2", "--batch-split", "40,20,4"], fast=False),
    Case("train-batch-split-sum", ["train", "-n", "2", "--max-steps", "2", "--batch-split", "40,20"], fast=False),
    Case("train-batch-split-accum", ["train", "-n", "2", "--max-steps", "2", "--grad-accum", "2", "--batch-split", "41,23"],
         fast=False),
    Case("train-batch-split-localsgd", ["train", "-n", "2", "--max-steps", "2", "--comm", "localsgd", "--batch-split",
                                        "speed"], fast=False),
    Case("train-batch-split-no-breakdown", ["train", "-n", "2", "--max-steps", "2", "--no-breakdown", "--batch-split",
                                            "speed"], fast=False),
    Case("train-batch-split-tp", ["train", "-n", "2", "--max-steps", "2", "--task", "lm", "--parallel", "tp=2",
                                  "--batch-split", "20,12"], fast=False),
    Case("train-batch-split-pipeline", ["train", "-n", "2", "--max-steps", "2", "--task", "lm", "--task-arg", "tie=false",
                                        "--strategy", "pipeline", "--batch-split", "speed"], fast=False),
    # --fault-tolerance (issue 55)
    Case("train-ft-min-0", ["train", "--fault-tolerance", "min=0"]),
    Case("train-ft-unknown-key", ["train", "--fault-tolerance", "size=2"]),
    Case("train-ft-heartbeat-0", ["train", "--fault-tolerance", "heartbeat=0"]),
    Case("train-ft-lighthouse-port", ["train", "--fault-tolerance", "--lighthouse", "127.0.0.1:99999"]),
    Case("train-ft-hsdp", ["train", "--fault-tolerance", "--strategy", "hsdp"]),  # fsdp inside a group trains since f745e9a
    Case("train-ft-strategy-pipeline", ["train", "--fault-tolerance", "--strategy", "pipeline"]),
    Case("train-ft-parallel-auto", ["train", "--fault-tolerance", "--parallel", "auto"]),
    Case("train-ft-tp-not-filling-nproc", ["train", "--fault-tolerance", "--parallel", "tp=2", "-n", "3"]),
    # mistakes every replica group met at its start (each printed its line): the launcher refuses them now
    Case("train-ft-pp-fewer-blocks", [*FT, "--task", "lm", "--task-arg", "layers=1", "-n", "2", "--parallel", "pp=2"]),
    Case("train-ft-pp-tied", [*FT, "--task", "lm", "-n", "2", "--parallel", "pp=2"]),
    Case("train-ft-pp-microbatches", [*FT, "--task", "lm", "--task-arg", "tie=false", "-n", "2", "--parallel", "pp=2",
                                      "--batch-size", "6"]),
    Case("train-ft-pp-accum-microbatches", [*FT, "--task", "lm", "--task-arg", "tie=false", "-n", "2", "--parallel", "pp=2",
                                            "--grad-accum", "8"]),
    Case("train-ft-tp-heads", [*FT, "--task", "lm", "--task-arg", "heads=4", "-n", "3", "--parallel", "tp=3"]),
    Case("train-ft-tp-no-plan", [*FT, "--task", "digits", "-n", "2", "--parallel", "tp=2"]),
    Case("train-ft-task-arg", [*FT, "--task", "synthetic", "--task-arg", "classes=0", "-n", "2"]),
    Case("train-ft-unknown-optimizer", [*FT, "--task", "synthetic", "--optimizer", "nosuch", "-n", "2"]),
    Case("train-ft-unknown-task", [*FT, "--task", "nosuch", "-n", "2"]),
    Case("train-ft-no-data", [*FT, "--task", "mnist", "--data-dir", "nosuchdir", "-n", "2"]),
    Case("train-ft-device-tpu", [*FT, "--device", "tpu", "-n", "2"]),
    Case("train-ft-float8-cpu", [*FT, "--device", "cpu", "--precision", "float8", "-n", "2"]),
    Case("train-ft-checkpoint-under-file", [*FT, "--checkpoint-dir", "afile/ck", "-n", "2"]),
    Case("train-ft-elastic-nnodes", ["train", "--fault-tolerance", "--nnodes", "1:2"]),
    Case("train-ft-nnodes-no-master", ["train", "--fault-tolerance", "--nnodes", "2"]),
    Case("train-ft-elastic-batch-global", ["train", "--fault-tolerance", "--elastic-batch", "global"]),
    Case("train-ft-micro-batch-auto", ["train", "--fault-tolerance", "--micro-batch", "auto"]),
    Case("train-ft-comm", ["train", "--fault-tolerance", "--comm", "fp16"]),
    Case("train-ft-comm-warmup", ["train", "--fault-tolerance", "--comm-warmup", "3"]),
    Case("train-ft-sync-bn", ["train", "--fault-tolerance", "--sync-bn"]),
    Case("train-ft-ac-no-blocks", [*FT, "--task", "digits", "--activation-checkpointing", "-n", "2"]),
    Case("train-ft-fsdp-channels-last", ["train", "--fault-tolerance", "--strategy", "fsdp", "-n", "2", "--channels-last"]),
    Case("train-ft-num-workers", [*FT, "--num-workers", "2"]),
    Case("train-ft-batch-split-speed", [*FT, "--batch-split", "speed"]),
    Case("train-ft-trace", [*FT, "--trace", "1:2"]),
    Case("train-ft-warmup-steps", [*FT, "--warmup-steps", "1"]),
    Case("train-ft-straggler-window", [*FT, "--straggler-window", "10"]),
    Case("train-ft-pp-pipeline-schedule", [*FT, "--parallel", "pp=2", "-n", "2", "--task", "lm", "--pipeline-schedule", "gpipe"]),
    Case("train-ft-master-port", [*FT, "--master-port", "29999"]),
    Case("train-ft-startup-timeout", [*FT, "--startup-timeout", "30"]),
    Case("train-ft-launcher-spawn", [*FT, "--launcher", "spawn"]),
    Case("train-ft-stall-timeout", [*FT, "--stall-timeout", "5"]),
    Case("train-ft-debug", [*FT, "--debug"]),
    Case("run-ft-comm", ["run", "--fault-tolerance", "--comm", "fp16", "ok.py"]),
    Case("run-ft-parallel", ["run", "--fault-tolerance", "--parallel", "tp=2", "ok.py"]),
    Case("run-ft-local-rank-arg", ["run", "--fault-tolerance", "--local-rank-arg=--local_rank", "ok.py"]),
    Case("run-ft-master-port", ["run", "--fault-tolerance", "--master-port", "29999", "ok.py"]),
    Case("train-replica-id-without-ft", [*S, "--replica-id", "b"]),
    Case("run-lighthouse-without-ft", ["run", "--lighthouse", "127.0.0.1:29510", "ok.py"]),
    Case("run-ft-min-0", ["run", "--fault-tolerance", "min=0", "ok.py"]),
    Case("run-ft-lighthouse-port", ["run", "--fault-tolerance", "--lighthouse", "127.0.0.1:99999", "ok.py"]),
    Case("run-ft-nnodes-no-master", ["run", "--fault-tolerance", "--nnodes", "2", "ok.py"]),
    Case("api-init-ft-no-job", py="dtrain.init(fault_tolerance=True)"),
    Case("api-init-ft-bad-type", py="dtrain.init(fault_tolerance=1)"),
    Case("api-init-ft-fsdp", py="dtrain.init(strategy='fsdp', fault_tolerance='min=1')"),
    Case("api-ledger-without-ft", py=CTX + "ctx.setup_dataloader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset("
         "torch.zeros(4, 1)), batch_size=2), ledger='l')"),
    Case("train-ft-lighthouse-unreachable", ["train", "--fault-tolerance", "--lighthouse", "127.0.0.1:1"], fast=False),
    # --parallel auto on several nodes (issue 54, item 3)
    Case("train-auto-elastic-no-ckpt", [*S, "--parallel", "auto", "--nnodes", "1:2", "--master-addr", "127.0.0.1"]),
    Case("train-auto-node1-no-pick", py="from dtrain.launch import autopick, store as st\nfrom dtrain.launch.spec import "
         "LaunchSpec\nfrom dtrain.train.config import TrainConfig, TaskConfig, ParallelConfig\ns, port = st.host_store("
         "'127.0.0.1', 0)\nautopick.receive(TrainConfig(task=TaskConfig(name='digits'), parallel=ParallelConfig(layout="
         "'auto')), LaunchSpec(nproc=1, nnodes=2, node_rank=1, master_addr='127.0.0.1', master_port=port, "
         "startup_timeout=1))", fast=False),
    # --launcher ray (issue 56, item 3)
    Case("ray-no-cluster", ["train", "--launcher", "ray", "--ray-address", "127.0.0.1:9", "-n", "2"]),
    Case("ray-address-form", ["train", "--launcher", "ray", "--ray-address", "nonsense", "-n", "2"]),
    Case("ray-address-without-ray-launcher", ["train", "--ray-address", "10.0.0.1:6379", "-n", "2"]),
    Case("ray-master-addr", ["run", "--launcher", "ray", "--master-addr", "10.0.0.1", "-n", "2", "train.py"]),
    Case("ray-elastic", ["train", "--launcher", "ray", "--nnodes", "1:2", "--master-addr", "10.0.0.1"]),
    Case("ray-not-installed", py="import sys; sys.modules['ray'] = None; from dtrain.cli import main; "
         "sys.exit(main(['train', '--launcher', 'ray', '-n', '2']))"),
    # Hugging Face models (issue 56)
    Case("train-hf-missing-folder", ["train", "--task", "hf:nosuchdir"]),
    Case("train-hf-hub-name", ["train", "--task", "hf:meta-llama/Llama-3.2-1B"]),
    Case("train-hf-no-config", ["train", "--task", "hf:emptydir"]),
    Case("train-hf-a-file", ["train", "--task", "hf:afile"]),
    Case("train-hf-unknown-model-type", py="import os; os.makedirs('odd'); open('odd/config.json', 'w').write("
         "'{\"model_type\": \"no-such-model\"}'); from dtrain.tasks import load_task; load_task('hf:odd')"),
    Case("train-hf-tp-not-dividing-heads", py="from transformers import LlamaConfig; LlamaConfig(vocab_size=256, "
         "hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)"
         ".save_pretrained('m'); from dtrain.tasks import load_task; t = load_task('hf:m', options={'context': '16', "
         "'max_bytes': '20000'}); t.tp_plan(t.new_model(), 4)", fast=False),
    Case("train-init-from-not-hf", ["train", "--task", "lm", "--init-from", "emptydir"]),
    Case("ckpt-export-target-exists", ["ckpt", "export", "crafted", "--hf", "emptydir", "--config", "emptydir"]),
    Case("ckpt-export-config-without-config-json", ["ckpt", "export", "crafted", "--hf", "newout", "--config", "emptydir"]),
    Case("ckpt-export-unwritable", ["ckpt", "export", "crafted", "--hf", "/proc/x", "--config", "emptydir"]),
    Case("train-init-from-other-shape", py="from transformers import LlamaConfig, AutoModelForCausalLM; c = dict(vocab_size=256, "
         "intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64); "
         "LlamaConfig(hidden_size=32, **c).save_pretrained('m'); AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, **c))"
         ".save_pretrained('w'); from dtrain.tasks import load_task; t = load_task('hf:m', options={'context': '16', "
         "'max_bytes': '40000', 'init_from': 'w'}); t.load_weights(t.new_model())", fast=False),
]
"""The flags of issues 53-56 (plan float8, --micro-batch auto, --batch-split, --fault-tolerance, hf:PATH);
``--set latest``."""

ALL_CASES = [*CASES, *NEW_FLAG_CASES, *ISSUE51_CASES, *LATEST_CASES]
"""What the benchmark runs: issue 22's cases (``CASES``, tried by tests/{logic,multiprocess}/cli/test_bad_inputs.py)
and issue 32's (``NEW_FLAG_CASES``, tried by tests/{logic,multiprocess}/cli/test_bad_inputs_new_flags.py)."""

TASKS_BAD = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
NOT_CALLABLE = 3

def returns_none():
    return None

def unknown_fields():
    return {"build_model": lambda: nn.Linear(4, 2), "train_set": DATA, "colour": "red"}

def model_not_module():
    return {"build_model": lambda: "a model", "train_set": DATA}

def train_set_int():
    return {"build_model": lambda: nn.Linear(4, 2), "train_set": 64}

def lr_negative():
    return {"build_model": lambda: nn.Linear(4, 2), "train_set": DATA, "lr": -0.5}

def batch_size_str():
    return {"build_model": lambda: nn.Linear(4, 2), "train_set": DATA, "batch_size": "32"}

def loss_not_callable():
    return {"build_model": lambda: nn.Linear(4, 2), "train_set": DATA, "loss_fn": "cross_entropy"}

def needs_argument(width):
    return {"build_model": lambda: nn.Linear(4, width), "train_set": DATA}
'''

SNIPPET = """
import sys
import dtrain, torch
from torch import nn
import dtrain.tasks
try:
    exec(compile(sys.argv[1], "<case>", "exec"), {"dtrain": dtrain, "torch": torch, "nn": nn})
except dtrain.DtrainError as exc:
    print(f"dtrain: error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def make_fixtures(folder: str) -> None:
    """The files the cases name, in ``folder`` (the cases' working directory)."""
    with open(os.path.join(folder, "afile"), "w") as fh:
        fh.write("a plain file\n")
    os.makedirs(os.path.join(folder, "emptydir"), exist_ok=True)
    os.makedirs(os.path.join(folder, "dir.toml"), exist_ok=True)
    with open(os.path.join(folder, "ok.py"), "w") as fh:
        fh.write("print('ok')\n")
    with open(os.path.join(folder, "job.yaml"), "w") as fh:
        fh.write("name: job\nnodes: 2\n")
    with open(os.path.join(folder, "bad.toml"), "w") as fh:
        fh.write("name = \n")
    with open(os.path.join(folder, "unknown_key.toml"), "w") as fh:
        fh.write('name = "x"\ncommand = ["dtrain", "train"]\ncolour = "red"\n')
    with open(os.path.join(folder, "random.bin"), "wb") as fh:
        fh.write(os.urandom(4096))
    with open(os.path.join(folder, "tasks_bad.py"), "w") as fh:
        fh.write(TASKS_BAD)
    with open(os.path.join(folder, "tasks_syntax.py"), "w") as fh:
        fh.write("def make(:\n    pass\n")
    make_crafted_checkpoint(os.path.join(folder, "crafted"), os.path.join(folder, "PWNED"))
    make_new_flag_fixtures(folder)
    os.mkfifo(os.path.join(folder, "fifo"))  # issue 51: a named pipe given as a file must not block
    _write(os.path.join(folder, "neg.json"), '{"device": "h100", "intra_latency_us": -5}')
    _write(os.path.join(folder, "l_neg.json"), _LINKS_NEG)


def _write(path: str, text: str | bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb" if isinstance(text, bytes) else "w") as fh:
        fh.write(text)


_TEMPLATES: dict[str, str] = {}


def _function_checkpoints() -> str:
    """A folder (built once per run, then copied) with ``funcck/``: step 1 a valid training state,
    step 2 (``latest``) one whose state.pt pickles a function under correct checksums, and
    ``func.pt``, a torch.save file holding a function."""
    if "func" not in _TEMPLATES:
        import hashlib
        import json

        import torch

        tmpl = tempfile.mkdtemp(prefix="dtrain-bad-tmpl-")
        for step, extra in ((1, {}), (2, {"hook": os.getcwd})):
            folder = os.path.join(tmpl, "funcck", f"step-{step:08d}")
            os.makedirs(folder)
            state = {"objects": {"model": {"w": torch.full((2,), float(step))}}, "extra": extra, "step": step,
                     "world_size": 1, "rng": [], "sharded": []}
            torch.save(state, os.path.join(folder, "state.pt"))
            with open(os.path.join(folder, "state.pt"), "rb") as fh:
                data = fh.read()
            manifest = {"format": 1, "step": step, "world_size": 1,
                        "files": {"state.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
            _write(os.path.join(folder, "manifest.json"), json.dumps(manifest))
        _write(os.path.join(tmpl, "funcck", "latest"), "step-00000002\n")
        torch.save({"f": print}, os.path.join(tmpl, "func.pt"))
        _TEMPLATES["func"] = tmpl
        atexit.register(shutil.rmtree, tmpl, True)
    return _TEMPLATES["func"]


LEDGERS = {
    "ledger_types": '{"begin": 0, "n": 8}\n{"s": 1, "e": 0, "i": 5}\n{"s": 1, "e": "zero", "i": [1]}\n',
    "ledger_header": '{"begin": "abc", "n": 8}\n',
    "ledger_strings": '{"begin": 0, "n": 8}\n{"s": "1", "e": 0, "i": [0, 1]}\n{"s": 2, "e": 0, "i": ["2", "3"]}\n',
    "ledger_lists": '[1, 2]\n"text"\n{"x": 1}\n',
    "ledger_range": '{"begin": 0, "n": 4}\n{"s": 1, "e": 0, "i": [7, 99]}\n',
    "ledger_huge": '{"begin": 0, "n": 200000000}\n{"s": 1, "e": 0, "i": [0, 1]}\n',
}
RUNS = {
    "run_ok": ('{"step": 1, "train_loss": 2.0, "samples_per_s": 10.0}\n', None),
    "run_strings": ('{"step": "5", "train_loss": 1.0}\n{"step": true}\n', None),
    "run_result_list": ('{"step": 1, "train_loss": 2.0}\n', "[1, 2, 3]\n"),
    "run_fields": ('{"step": 1, "train_loss": "low", "samples_per_s": [1], "breakdown": "none", "peak_mib": {"a": 1}, '
                   '"stragglers": [1]}\n', '{"mfu": "high", "breakdown": 5}\n'),
}
TRACE_GARBAGE = '{"traceEvents": [{"ph": "X", "ts": "a", "dur": 1, "pid": 0, "name": "forward"}], "otherData": [1]}\n'
NEEDS_LOCAL_RANK = """import argparse
p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, required=True)
p.parse_args()
"""


def make_new_flag_fixtures(folder: str) -> None:
    """Issue 32's inputs: broken ledgers and run folders, scripts for --local-rank-arg, checkpoints
    that pickle a function."""
    _write(os.path.join(folder, "plain.py"), "import argparse\np = argparse.ArgumentParser()\np.add_argument('-a')\np.parse_args()\n")
    _write(os.path.join(folder, "needs_lr.py"), NEEDS_LOCAL_RANK)
    tmpl = _function_checkpoints()
    shutil.copytree(os.path.join(tmpl, "funcck"), os.path.join(folder, "funcck"))
    shutil.copy(os.path.join(tmpl, "func.pt"), os.path.join(folder, "func.pt"))
    name = "gen00001-rank00000.jsonl"
    _write(os.path.join(folder, "ledger_binary", name), bytes(range(256)) * 12)
    for d, text in LEDGERS.items():
        _write(os.path.join(folder, d, name), text)
    os.makedirs(os.path.join(folder, "ledger_dirfile", name))
    for d, (metrics, result) in RUNS.items():
        _write(os.path.join(folder, d, "metrics.jsonl"), metrics)
        if result is not None:
            _write(os.path.join(folder, d, "result.json"), result)
    _write(os.path.join(folder, "run_binary", "metrics.jsonl"), bytes(range(256)) * 12)
    os.makedirs(os.path.join(folder, "run_dir_metrics", "metrics.jsonl"))
    _write(os.path.join(folder, "run_trace", "metrics.jsonl"), RUNS["run_ok"][0])
    _write(os.path.join(folder, "run_trace", "trace.json"), TRACE_GARBAGE)


class _Boom:
    """Unpickling this runs a shell command (the crafted checkpoint of issue 22)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def make_crafted_checkpoint(folder: str, marker: str) -> None:
    """A folder with a sharded-looking checkpoint whose ``.metadata`` pickle runs a command.

    Not a full copy of the issue's checkpoint (which also has a valid state.pt and manifest):
    enough to see whether ``ckpt verify`` unpickles what a folder holds (the marker file appears)."""
    step = os.path.join(folder, "step-00000001", "sharded")
    os.makedirs(step, exist_ok=True)
    with open(os.path.join(step, ".metadata"), "wb") as fh:
        pickle.dump(_Boom(marker), fh)
    with open(os.path.join(folder, "latest"), "w") as fh:
        fh.write("step-00000001\n")


@dataclass
class Result:
    case: Case
    verdict: str
    rc: int | None
    seconds: float
    last_line: str


def classify(rc: int | None, out: str, err: str, case: Case | None = None) -> tuple[str, str]:
    """(verdict, last stderr line): clear, traceback, hang, silent (exit 0 where a refusal or a
    named warning was due), or other. A case with ``says`` is clear when it exits with its ``rc``
    and its output says that."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else ""
    if rc is None:
        return "hang", last
    text = out + err
    if "Traceback" in text or "frame #" in text:
        return "traceback", last
    if case is not None and case.says is not None:
        said = [ln for ln in text.splitlines() if case.says in ln]
        if rc == case.rc and said:
            return "clear", said[-1].strip()
        return ("silent" if rc == 0 else "other"), last
    errors = [ln for ln in lines if ln.startswith("dtrain: error:")]
    if rc == 2 and last.startswith("dtrain: error:") and len(errors) == 1:
        return "clear", last
    return ("silent" if rc == 0 else "other"), last


def command(case: Case) -> list[str]:
    if case.py is not None:
        return [sys.executable, "-c", SNIPPET, case.py]
    return [sys.executable, "-m", case.module, *case.argv]


def _mem_cap(gib: float | None):  # noqa: ANN202
    if gib is None:
        return None

    def cap() -> None:
        import resource

        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return cap


def run_case(case: Case, timeout: float) -> Result:
    folder = tempfile.mkdtemp(prefix="dtrain-bad-")
    try:
        make_fixtures(folder)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRAIN_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_"))}
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(SRC), folder, ROOT])  # ROOT: a module case's tests.support
        env.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.monotonic()
        proc = subprocess.Popen(command(case), cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, preexec_fn=_mem_cap(case.mem_gib))
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            rc = None
        verdict, last = classify(rc, out, err, case)
        if os.path.exists(os.path.join(folder, "PWNED")):
            verdict, last = "other", f"RAN CODE FROM THE CHECKPOINT; {last}"
        return Result(case, verdict, rc, time.monotonic() - t0, last)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


VERDICTS = ("clear", "traceback", "silent", "hang", "other")


def table(results: list[Result]) -> str:
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    return (
        "| tried | one line (or named warning / verdict) | tracebacks | silent | hangs | other |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: |\n"
        f"| {len(results)} | {counts['clear']} | {counts['traceback']} | {counts['silent']} | {counts['hang']} | {counts['other']} |\n"
    )


def per_case(results: list[Result]) -> str:
    rows = ["| case | verdict | exit | s | owner | last stderr line |", "| --- | --- | ---: | ---: | --- | --- |"]
    for r in results:
        line = r.last_line.replace("|", "\\|")[:160]
        rows.append(f"| {r.case.id} | {r.verdict} | {r.rc} | {r.seconds:.1f} | {r.case.owner} | {line} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default=None, help="only cases whose id contains this")
    parser.add_argument("--set", choices=("all", "old", "new", "issue51", "latest"), default="all",
                        help="old: issue 22's cases; new: issue 32's (the flags added since); issue51: issue 51's classes; latest: issues 53-56's flags; all (default)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--jobs", type=int, default=2, help="cases at a time")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="write the table and the per-case list here")
    parser.add_argument("--src", default=None, help="the dtrain sources to try (default: this checkout's src/), e.g. an older commit's")
    args = parser.parse_args()
    global SRC
    SRC = args.src or SRC
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    chosen = {"all": ALL_CASES, "old": CASES, "new": NEW_FLAG_CASES, "issue51": ISSUE51_CASES, "latest": LATEST_CASES}[args.set]
    cases = [c for c in chosen if args.k is None or args.k in c.id]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: run_case(c, args.timeout), cases))
    for r in results:
        if r.verdict != "clear":
            print(f"{r.verdict:<9} {r.case.id}: rc={r.rc} {r.last_line[:150]}", file=sys.stderr)
    text = table(results)
    print(text)
    if args.markdown:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.markdown, "w") as fh:
            src = f" --src {args.src}" if args.src else ""
            src += f" --set {args.set}" if args.set != "all" else ""
            src += f" -k {args.k}" if args.k else ""
            fh.write(f"# Bad inputs, {stamp}\n\n`python benchmarks/bad_inputs.py --markdown {args.markdown}{src}` on "
                     f"{platform.node()} ({os.cpu_count()} cores, Python {platform.python_version()})\n\n")
            fh.write(text + "\n" + per_case(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
