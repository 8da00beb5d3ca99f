"""`dtrain train --task hf:DIR` on two hosts of the network test bed (needs root): a small Llama-style folder
written here (no download), one rank per host, `--strategy fsdp` (or --strategy), hosts with their own names
and sharing one host name; checks both nodes exit 0, every step committed by rank 1 in the ledger, and the result.

    python3 benchmarks/hf_bed.py --steps 10 --strategy fsdp
    python3 benchmarks/hf_bed.py --steps 10 --parallel tp=2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.support: the harness that only tests and benchmarks use


def one(shared_name: str | None, steps: int, strategy: str, port: int, parallel: str | None = None) -> dict:
    from tests.support.netbed import NetBed
    from transformers import LlamaConfig

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with tempfile.TemporaryDirectory() as tmp, NetBed(hosts=2, shared_name=shared_name) as bed:
        model = os.path.join(tmp, "llama")
        LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128).save_pretrained(model)
        ledger = os.path.join(tmp, "ledger")
        cmd = [sys.executable, "-m", "dtrain", "train", "--task", f"hf:{model}", "--task-arg", "context=64",
               "--task-arg", "max_bytes=40000", *(["--parallel", parallel] if parallel else ["--strategy", strategy]), "--nnodes", "2", "-n", "1",
               "--master-addr", bed.addresses[0], "--master-port", str(port), "--max-steps", str(steps),
               "--log-every", str(steps), "--ledger", ledger, "--startup-timeout", "180"]
        procs = [bed.popen(r, [*cmd, "--node-rank", str(r)], stderr=subprocess.PIPE, env=env, cwd=tmp) for r in (0, 1)]
        outs = [p.communicate(timeout=600) for p in procs]
        codes = [p.returncode for p in procs]
        rank1 = Path(ledger, "gen00001-rank00001.jsonl").read_text().splitlines() if os.path.exists(ledger) else []
    result = next((json.loads(x) for x in reversed(outs[0][0].splitlines()) if x.startswith("{")), {})
    steps1 = [json.loads(x)["s"] for x in rank1[1:]]
    ok = codes == [0, 0] and steps1 == list(range(1, steps + 1)) and result.get("world_size") == 2
    return {"case": shared_name or "own names", "ok": ok, "codes": codes, "strategy": result.get("strategy"),
            "world_size": result.get("world_size"), "rank1_steps": len(steps1), "train_loss": result.get("train_loss"),
            "val_loss": result.get("val_loss"), "tokens_per_s": result.get("tokens_per_s"),
            "tail": "" if ok else "\n".join((outs[0][1] + outs[1][1]).splitlines()[-12:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="own,vm", help="own (each host its own name) and/or a shared host name (e.g. vm)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--port", type=int, default=29751)
    p.add_argument("--parallel", default=None, help="a layout for --parallel instead of --strategy (e.g. tp=2)")
    args = p.parse_args()
    rows = [one(None if case == "own" else case, args.steps, args.strategy, args.port, args.parallel) for case in args.cases.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
