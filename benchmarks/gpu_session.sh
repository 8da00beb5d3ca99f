#!/bin/bash
# One lent-GPU session in one call (device time counts from start-up), each step within what is left of BUDGET
# seconds, logs and JSON lines in $OUT (or /tmp/gpu-session). Runs from the repository root, dtrain from src/ (no
# install). Steps, in order of what matters most:
#   gpu_tier   the GPU tier (tests/gpu: NCCL collectives on a one-rank group, DDP over NCCL, bf16/fp16, FSDP with
#              its mixed-precision policy, float8, the fused optimizer, compile, the dry run on the device)
#   float8     float8 against bf16 tokens/s, both compiled, on an LM whose linears gain (float8_vs_bf16.py)
#   fsdp       FSDP under bf16-mixed on one rank: this tree (bf16 gathers) against OLD_SRC's (fp32 gathers)
#   dryrun     dtrain dry-run -n 1 against a real 1-GPU run of the same configuration (peak memory)
#   vs_plain   the earlier lm table: dtrain against plain loops (gpu_vs_plain.py, one round)
#   plan_gpu   dtrain plan against dtrain train on this GPU
# torchao is not on the lent machine: wheels in .whl/ (carried) are installed into /tmp/site first, if present.
#
#     BUDGET=470 OLD_SRC=$PWD/.oldsrc/src bash benchmarks/gpu_session.sh
#     STEPS="float8 fsdp" BUDGET=300 bash benchmarks/gpu_session.sh          # some steps only
#     QUICK=1 DEVICE=cpu STEPS="fsdp dryrun" bash benchmarks/gpu_session.sh  # tiny sizes on the CPU: the steps run
set -u
export OUT=${OUT:-/tmp/gpu-session}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
end=$(( $(date +%s) + ${BUDGET:-470} ))
left() { local l=$(( end - $(date +%s) - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
want() { case " ${STEPS:-gpu_tier float8 fsdp dryrun vs_plain plan_gpu} " in *" $1 "*) return 0;; esac; return 1; }
step() {  # step NAME CAP COMMAND...: run within min(CAP, time left), log to $OUT/NAME.log
  local name=$1 cap; cap=$(left "$2"); shift 2
  want "$name" || return
  if [ "$cap" -le 20 ]; then echo "$name: skipped (no time left)"; return; fi
  local t0 pid timer rc; t0=$(date +%s)
  # its own process group, ended whole at the cap: the benchmarks' own children (dtrain train) with it
  setsid "$@" > "$OUT/$name.log" 2>&1 & pid=$!
  ( sleep "$cap"; kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null ) & timer=$!
  wait "$pid"; rc=$?
  kill "$timer" 2>/dev/null; wait "$timer" 2>/dev/null
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (cap $cap s)"
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), 'numpy', numpy.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step gpu_tier 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout 170 -o addopts="-ra --strict-markers --durations=15" ${TIER_K:+-k "$TIER_K"}
step float8 200 python3 benchmarks/float8_vs_bf16.py --rounds "${F8_ROUNDS:-1}" --steps 200 --budget 60 --out "$OUT/float8.jsonl" --logs "$OUT/float8-stderr.log"

# the LM of the fsdp and dryrun steps (QUICK=1: tiny, on any device, to check the steps run)
export FSDP_ORDER=${FSDP_ORDER:-old new new old} DEVICE=${DEVICE:-cuda} QUICK=${QUICK:-0} FSDP_STEPS=$([ "${QUICK:-0}" = 1 ] && echo 14 || echo 60)
lm_args() {
  if [ "$QUICK" = 1 ]; then echo "--task-arg layers=1 --task-arg heads=2 --task-arg width=32 --task-arg context=32 --task-arg max_bytes=200000 --batch-size 4"
  else echo "--task-arg layers=8 --task-arg heads=16 --task-arg width=2048 --task-arg context=1024 --task-arg max_bytes=8000000 --batch-size 8"; fi
}
fsdp_side() {  # fsdp_side NAME SRC: one dtrain train of the lm under fsdp, bf16-mixed, on this GPU
  PYTHONPATH="$2:${PYTHONPATH#$PWD/src:}" python3 -m dtrain train --task lm --strategy fsdp --precision bf16-mixed -n 1 \
    $(lm_args) --device "$DEVICE" --max-steps "$FSDP_STEPS" --warmup-steps 10 --log-every "$FSDP_STEPS" --metrics-file "$OUT/fsdp-$1.jsonl" 2>"$OUT/fsdp-$1.err" | tail -1 \
    | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('$1', 'tokens/s', r['tokens_per_s'], 'loss', r['train_loss'])"
}
fsdp_pair() { for s in ${FSDP_ORDER:-old new new old}; do fsdp_side "$s" "$([ "$s" = old ] && echo "${OLD_SRC:-$PWD/.oldsrc/src}" || echo "$PWD/src")"; done; }
export -f lm_args fsdp_side fsdp_pair
[ -d "${OLD_SRC:-$PWD/.oldsrc/src}" ] && step fsdp 120 bash -c fsdp_pair

dryrun_pair() {
  local shape=(--task lm $(lm_args) --precision bf16-mixed --strategy fsdp -n 1 --device "$DEVICE")
  python3 -m dtrain dry-run "${shape[@]}" --steps 3 --json > "$OUT/dryrun.json" 2> "$OUT/dryrun.err"
  python3 -m dtrain train "${shape[@]}" --max-steps 3 --warmup-steps 1 --log-every 1 --metrics-file "$OUT/dryrun-real.jsonl" 2> "$OUT/dryrun-real.err" | tail -1 > "$OUT/dryrun-real.json"
  python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
dry = json.loads(open(f"{out}/dryrun.json").read().strip().splitlines()[-1])
recs = [json.loads(ln) for ln in open(f"{out}/dryrun-real.jsonl") if ln.strip()]
real = max((r.get("peak_mib") or [0])[0] or 0 for r in recs)
print(f"dry run peak {dry['peak_mib']:.0f} MiB, real 1-GPU run peak {real:.0f} MiB: {dry['peak_mib'] / real - 1:+.1%}")
EOF
}
export -f dryrun_pair
step dryrun 90 bash -c dryrun_pair
step vs_plain 160 python3 benchmarks/gpu_vs_plain.py --only lm --rounds 1 --logs "$OUT/gpu_vs_plain-stderr.log" --out "$OUT/gpu_vs_plain.jsonl"
step plan_gpu 120 python3 benchmarks/plan_gpu.py --repeats 1 --out "$OUT/plan_gpu.jsonl"
for f in gpu_tier float8 fsdp dryrun vs_plain plan_gpu; do [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -22 "$OUT/$f.log"; }; done
