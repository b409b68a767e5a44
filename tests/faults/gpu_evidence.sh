#!/usr/bin/env bash
# Issue 35 evidence: what ends each rank when one rank exits or stalls mid-step, in every check
# mode and both nccl_ep modes, with the thread dumps of the ranks still waiting.
#
#   bash tests/faults/gpu_evidence.sh                        # W=2, from the repository root, built in place
#   WORLD_SIZE=4 PG_TIMEOUT_S=10 bash tests/faults/gpu_evidence.sh   # W=4 on GPUs 0-3
#
# Runs the fault cases rank_exits_mid_step and rank_sleeps_past_timeout (python3 -m tests.faults)
# at a PG_TIMEOUT_S (default 20 s) process-group timeout for checks local, device and synchronous,
# each in nccl_ep modes staged and zero_copy (six runs). Every rank dumps the Python stack and the
# kernel state of every thread (/proc: wait channel, system call) 0.6 and 1.5 process-group
# timeouts after its body starts (only ranks still alive then do); NCCL_DEBUG=WARN. At W=2 with 4
# GPUs two runs go side by side (GPUs 0,1 and 2,3), else one after the other on GPUs 0..W-1. First
# the harness's fault-free warm-up fills NCCL EP's kernel cache (staged and zero-copy;
# WARM_LIMIT_S, default 300 s), then each fault run is bounded by `timeout` (RUN_LIMIT_S, default
# 200 s), which ends the harness and every rank it started (one process group). Then: the
# processes left on the GPUs, a fault-free case on the same GPUs, and (ONE_GPU_TESTS=1, the
# default) the one-GPU watchdog tests (tests/gpu/test_watchdog.py, the GPU side of the watchdog).
# About 5 minutes at W=2 with 4 GPUs and a warm cache.
#
# Writes $OUT/faults_wW.log (everything) and $OUT/faults_wW_summary.txt (one line per case: which
# limit ended each rank, after how many seconds from the fault). OUT defaults to ./gpu_logs.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
W=${WORLD_SIZE:-2}
LOG="$OUT/faults_w$W.log"
SUMMARY="$OUT/faults_w${W}_summary.txt"
RUN_LIMIT_S=${RUN_LIMIT_S:-200}
WARM_LIMIT_S=${WARM_LIMIT_S:-300}
PG_TIMEOUT_S=${PG_TIMEOUT_S:-20}
DUMP_AT=$(python3 -c "print(round(0.6 * $PG_TIMEOUT_S, 1), round(1.5 * $PG_TIMEOUT_S, 1))")
VARIANTS="local_staged local_zero_copy device_staged device_zero_copy synchronous_staged synchronous_zero_copy"
WORK=$(mktemp -d /tmp/te_ep_i35.XXXXXX)
: > "$LOG"
: > "$SUMMARY"
start=$(date +%s)

log() { echo "$*" | tee -a "$LOG"; }

log "=== issue 35 evidence at W=$W, $(date -u +%FT%TZ), $(hostname) ==="
log "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv 2>&1 | tee -a "$LOG"
python3 -m te_ep_torch 2>&1 | tee -a "$LOG"
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, te_ep_torch  # noqa: F401
print("watchdog:", te_ep_torch.ops.watchdog_state(),
      "| host-scope watchdog in this build:", hasattr(torch.ops.te_ep, "_watchdog_test_hold"))
EOF
env | grep -E "^(CUDA_MODULE_LOADING|CUDA_VISIBLE_DEVICES|NCCL_|TORCH_NCCL|TE_EP_)" 2>&1 | tee -a "$LOG"
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
log "GPUs: $ngpu; W=$W; run limit ${RUN_LIMIT_S} s each; PG timeout ${PG_TIMEOUT_S} s"
if [ "$ngpu" -lt "$W" ]; then log "needs $W GPUs"; exit 1; fi

# run <gpus> <tag>: one harness invocation for variant <tag> (<checks>_<mode>), its output into $WORK/<tag>.out
run() {
  local gpus=$1 tag=$2
  local checks=${tag%%_*} mode=${tag#*_}
  local t0
  t0=$(date +%s)
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus NCCL_DEBUG=WARN TMPDIR="$WORK/tmp_$tag" PYTHONFAULTHANDLER=1 \
    timeout -k 10 "$RUN_LIMIT_S" python3 -m tests.faults --backend nccl_ep --world-size "$W" \
    --pg-timeout "$PG_TIMEOUT_S" -k rank_exits_mid_step rank_sleeps_past_timeout -v \
    --dump-after $DUMP_AT --keep-logs "$WORK/logs_$tag" --summary "$WORK/summary_$tag" \
    --checks "$checks" --nccl-ep-mode "$mode" --no-warmup > "$WORK/$tag.out" 2>&1
  echo "exit code $? after $(( $(date +%s) - t0 )) s (124: ended by the run limit)" >> "$WORK/$tag.out"
}

# warm <gpus> <mode>: the harness's fault-free warm-up alone (no case matches -k)
warm() {
  local t0
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$1 TMPDIR="$WORK" timeout -k 10 "$WARM_LIMIT_S" python3 -m tests.faults --backend nccl_ep \
    --world-size "$W" --nccl-ep-mode "$2" -k no_case_has_this_name > "$WORK/warm_$2.out" 2>&1
  echo "warm-up ($2) exit code $? after $(( $(date +%s) - t0 )) s" >> "$WORK/warm_$2.out"
}

for tag in $VARIANTS; do mkdir -p "$WORK/tmp_$tag"; done
ALL=$(seq -s, 0 $((W - 1)))
if [ "$W" -eq 2 ] && [ "$ngpu" -ge 4 ]; then
  warm 0,1 staged &
  warm 2,3 zero_copy &
  wait
  { for tag in local_staged device_staged synchronous_staged; do run 0,1 $tag; done; } &
  { for tag in local_zero_copy device_zero_copy synchronous_zero_copy; do run 2,3 $tag; done; } &
  wait
else
  warm "$ALL" staged
  warm "$ALL" zero_copy
  for tag in $VARIANTS; do run "$ALL" $tag; done
fi
for mode in staged zero_copy; do
  log ""
  log "=============== warm-up $mode ==============="
  cat "$WORK/warm_$mode.out" >> "$LOG"
done

for tag in $VARIANTS; do
  log ""
  log "=============== run $tag ==============="
  cat "$WORK/$tag.out" >> "$LOG"
  [ -f "$WORK/summary_$tag" ] && cat "$WORK/summary_$tag" >> "$SUMMARY"
  # each rank's stderr: the watchdog's and NCCL's words, the thread dumps
  for f in "$WORK"/logs_"$tag"/*/rank*.stderr; do
    [ -f "$f" ] || continue
    log "--- $tag: ${f#"$WORK/logs_$tag/"} ---"
    cat "$f" >> "$LOG"
  done
  # cases the run limit cut short keep their directories: their ranks' stderr
  for f in "$WORK"/tmp_"$tag"/te_ep_fault_*/rank*.stderr; do
    [ -f "$f" ] || continue
    log "--- $tag (cut short by the run limit): ${f#"$WORK/tmp_$tag/"} ---"
    cat "$f" >> "$LOG"
  done
done

log ""
log "=============== after the faults: processes left on the GPUs, then a fault-free case ==============="
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 | tee -a "$LOG"
CUDA_VISIBLE_DEVICES=$ALL TMPDIR="$WORK" timeout -k 10 90 python3 -m tests.faults --backend nccl_ep --world-size "$W" \
  --pg-timeout "$PG_TIMEOUT_S" --controls -k control_no_fault --no-warmup >> "$LOG" 2>&1
log "control_no_fault exit code $?"

if [ "${ONE_GPU_TESTS:-1}" = 1 ]; then
  log ""
  log "=============== one GPU: tests/gpu/test_watchdog.py (the GPU side of the watchdog) ==============="
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 150 python3 -m pytest -q tests/gpu/test_watchdog.py >> "$LOG" 2>&1
  log "tests/gpu/test_watchdog.py exit code $?"
fi

{
  echo ""
  echo "=============== summary: which limit ended each rank, seconds from the fault ==============="
  cat "$SUMMARY"
  echo "total $(( $(date +%s) - start )) s"
} | tee -a "$LOG"
rm -rf "$WORK"
