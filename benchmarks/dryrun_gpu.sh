#!/bin/bash
# `dtrain dry-run` on one lent GPU, in one call: a Llama-3-8B-shaped lm (8.07 B parameters: width
# 4096, 32 layers, 32 heads, vocabulary 128256, context 8192, untied head, MLP hidden 18432) at
# worlds 8, 64 and 512 under FSDP and FSDP x TP, plus the small lm (fsdp, ddp) as a sanity check.
# One JSON record per run in $OUT/NAME.json (stderr in NAME.err), a summary line each on stdout.
#
#     CAP=150 bash benchmarks/dryrun_gpu.sh            # each run capped at CAP seconds
#     ONLY="8b-fsdp-8 8b-fsdp-tp-8" bash benchmarks/dryrun_gpu.sh
set -u
OUT=${OUT:-/tmp/dryrun-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
L8B="--task lm --task-arg width=4096 --task-arg layers=32 --task-arg heads=32 --task-arg vocab=128256
     --task-arg context=8192 --task-arg tie=false --task-arg ffn=18432 --batch-size 1 --precision bf16-mixed --steps 2 --device cuda"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$OUT/env.txt"

run() {  # run NAME FLAGS...
  local name=$1; shift
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return;; esac
  local t0=$(date +%s)
  timeout "${CAP:-150}" python3 -m dtrain dry-run --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  local rc=$?
  python3 - "$name" "$rc" "$(( $(date +%s) - t0 ))" "$OUT/$name.json" "$OUT/$name.err" <<'EOF'
import json, sys
name, rc, wall, out, err = sys.argv[1:]
try:
    r = json.loads(open(out).read().strip().splitlines()[-1])
    p = r["predicted"] or {}
    coll = ", ".join(f"{c['kind']}/{c['dim']} x{c['count']} {c['bytes'] / 2**20:.0f} MiB" for c in r["collectives"])
    print(f"{name}: rc={rc} {wall}s peak {r['peak_mib']:.0f} MiB (reserved {r['reserved_mib']}) plan {p.get('peak_mib')}; "
          f"state {r['state_mib']:.0f} MiB plan {p.get('state_mib')}; fits {r['fits']} of {r['device_memory_mib']:.0f}; {coll}")
except Exception:
    lines = [ln for ln in open(err).read().splitlines() if ln.strip()]
    print(f"{name}: rc={rc} {wall}s no record; {' | '.join(lines[-3:])}")
EOF
}

run small-fsdp --task lm -n 2 --strategy fsdp --device cuda
run small-ddp --task lm -n 2 --strategy ddp --device cuda
run 8b-fsdp-8 $L8B -n 8 --strategy fsdp
run 8b-fsdp-tp-8 $L8B -n 8 --parallel dp_shard=4,tp=2
run 8b-fsdp-64 $L8B -n 8 --nnodes 8 --strategy fsdp
run 8b-fsdp-tp-64 $L8B -n 8 --nnodes 8 --parallel dp_shard=32,tp=2
run 8b-fsdp-512 $L8B -n 8 --nnodes 64 --strategy fsdp
run 8b-fsdp-tp-512 $L8B -n 8 --nnodes 64 --parallel dp_shard=256,tp=2
