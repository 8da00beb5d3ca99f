#!/bin/bash
# One lent-GPU session in one call (device time counts from start-up): the GPU tier, then
# `dtrain plan` against `dtrain train` on the GPU (plan_gpu.py), then dtrain against plain loops
# (gpu_vs_plain.py, the lm table), each within what is left of BUDGET seconds. Logs and JSON lines
# go to $OUT (or /tmp/gpu-session). Runs from the repository root, dtrain from src/ (no install).
#
#     BUDGET=470 bash benchmarks/gpu_session.sh
#     BUDGET=300 TIER_K=mixed_precision PLAN_REPEATS=1 VS=0 bash benchmarks/gpu_session.sh   # a shorter rerun
#     VS_ROUNDS=2 VS_SIDES=dtrain-lm-compile,dtrain-lm-compile-nobd,plain-lm-compile VS_TORCH_LOGS=recompiles,graph_breaks \
#         bash benchmarks/gpu_session.sh      # the lm table's compiled sides, each side's stderr in gpu_vs_plain-stderr.log
set -u
OUT=${OUT:-/tmp/gpu-session}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
end=$(( $(date +%s) + ${BUDGET:-470} ))
left() { local l=$(( end - $(date +%s) - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
step() {  # step NAME CAP COMMAND...: run within min(CAP, time left), log to $OUT/NAME.log
  local name=$1 cap; cap=$(left "$2"); shift 2
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
  python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'numpy', numpy.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step gpu_tier 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --timeout 170 -o addopts="-ra --strict-markers --durations=15" ${TIER_K:+-k "$TIER_K"}
step plan_gpu 240 python3 benchmarks/plan_gpu.py --repeats "${PLAN_REPEATS:-2}" --out "$OUT/plan_gpu.jsonl"
if [ "${VS:-1}" = 1 ]; then step gpu_vs_plain 200 env ${VS_TORCH_LOGS:+TORCH_LOGS="$VS_TORCH_LOGS"} python3 benchmarks/gpu_vs_plain.py --only lm --rounds "${VS_ROUNDS:-1}" ${VS_SIDES:+--sides "$VS_SIDES"} --logs "$OUT/gpu_vs_plain-stderr.log" --out "$OUT/gpu_vs_plain.jsonl"; fi
for f in gpu_tier plan_gpu gpu_vs_plain; do echo "== $f"; tail -25 "$OUT/$f.log" 2>/dev/null; done
