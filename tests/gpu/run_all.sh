#!/usr/bin/env bash
# The whole GPU suite in one command, on a machine with CUDA GPUs:
#   bash tests/gpu/run_all.sh            # logs under ${TE_EP_LOG_DIR:-gpu_logs}
# Runs, for every world size W in ${TE_EP_WORLD_SIZES:-2 4} that the machine has GPUs for:
# the shared cases on the reference and nccl_ep backends (nccl_ep also against
# the reference), the nccl_ep smoke test, and the 1000-step soak at the largest
# W; the fault-injection cases (tests/faults) at W=2 (W=1 on one GPU) on nccl_ep. Every nccl_ep
# part runs once per nccl_ep mode in ${TE_EP_NCCL_EP_MODES:-staged zero_copy}, the suite and the
# faults once per check mode in ${TE_EP_CHECKS:-local device synchronous} as well. Then the
# permutation CUDA tests, the FP8 tests (quantize kernels, the FP8-dispatch MoE layer) and the
# overlap tests (communication stream vs sequential layer, bitwise, with a delayed stream), and the
# watchdog tests (one GPU: an nccl_ep op stalled behind a spinning kernel ends the process).
# Prints a summary line per part (its exit status, seconds and last result line) and exits
# non-zero if any part failed; the fault part also writes $LOG/faults_summary.txt, one line per
# case and variant: which limit ended each rank, after how long. Stopped (a caller's time limit,
# Ctrl-C), it ends the running part with every process below it, torchrun's workers included
# (tests/gpu/process_tree.sh), so a cut run leaves the GPUs free for the next.
# TE_EP_PARTS (default "suite smoke soak perm faults fp8 overlap watchdog") selects parts, e.g. to
# split the run across shorter commands.
#   bash tests/gpu/run_all.sh --quick    # every path once: each nccl_ep mode x check mode on a few
#                                        # cases (bf16 and FP8, eager, compiled and CUDA graph, their
#                                        # errors), the smoke test, a few fault cases at a 10 s process-
#                                        # group timeout (a rank that exits mid-step: the watchdog's host
#                                        # side, measured at W=2 and W=4), the
#                                        # watchdog's GPU side (tests/gpu/test_watchdog.py); no soak
# NCCL EP compiles its kernels per shape and world size on first use (NCCL_EP_JIT_CACHE_DIR):
# on a fresh machine, unpack the cache a run left (tar of the directory: the --quick suite's
# kernels at W=2 are 0.8 MB compressed) before starting, or the nccl_ep suite's first check
# mode pays about 150 s of compilation at W=2 (docs/results.md).
if [ "${1:-}" = "--quick" ]; then
  export TE_EP_SUITE_CASES=${TE_EP_SUITE_CASES:-"routing_exact fp8_dispatch_exact cuda_graph check_modes device_checks_op_arguments bad_input_tokens_dtype capacity_overflow"}
  export TE_EP_FAULT_CASES=${TE_EP_FAULT_CASES:-"expert_id_out_of_range tokens_dtype_one_rank rank_exits_mid_step"}
  export TE_EP_FAULT_PG_TIMEOUT=${TE_EP_FAULT_PG_TIMEOUT:-10}
  export TE_EP_WORLD_SIZES=${TE_EP_WORLD_SIZES:-2}
  export TE_EP_PARTS=${TE_EP_PARTS:-nccl_suite smoke faults fp8 overlap watchdog}
fi
set -uo pipefail
cd "$(dirname "$0")/../.."
# Stopped by a time limit or Ctrl-C, the script ends the running part's whole process tree
# (torchrun's workers included) instead of leaving it on the GPUs.
source tests/gpu/process_tree.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${TE_EP_LOG_DIR:-gpu_logs}
mkdir -p "$LOG"
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 1 ]; then
  echo "no CUDA GPU visible: nothing to run"
  exit 1
fi
PARTS=" ${TE_EP_PARTS:-suite smoke soak perm faults fp8 overlap watchdog} "
# nccl_ep's modes: the suite, smoke, soak and fault parts run once per mode.
MODES=${TE_EP_NCCL_EP_MODES:-staged zero_copy}
want() { [[ "$PARTS" == *" $1 "* ]]; }
status=0
summary=()
run() {  # name, log file, command...
  local name=$1 log=$2
  shift 2
  echo "=== $name" | tee -a "$log"
  local t0=$SECONDS
  run_in_tree "$@" >>"$log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "^[0-9]+ passed, [0-9]+ failed|passed|failed" "$log" | tail -1)
  summary+=("$(printf '%-44s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$last")")
  [ $rc -eq 0 ] || status=1
}
CHECKS=${TE_EP_CHECKS:-local device synchronous}
largest=0
for w in ${TE_EP_WORLD_SIZES:-2 4}; do  # 1: the one-rank cases of run_suite.py (one GPU)
  [ "$w" -le "$ngpu" ] || continue
  largest=$w
  want suite && [ "$w" -ge 2 ] && run "suite W=$w backend=reference" "$LOG/suite.log" \
    timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" tests/gpu/run_suite.py --backend reference
  for mode in $MODES; do
    for checks in $CHECKS; do
      # checks=synchronous: the cases that need every rank to raise in the op (the other
      # modes run every case but those, on good steps and their own error cases).
      agreement=include; [ "$checks" = synchronous ] && [ "$w" -ge 2 ] && agreement=only
      { want suite || want nccl_suite; } && run "suite W=$w nccl_ep mode=$mode checks=$checks" "$LOG/suite.log" \
        timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" tests/gpu/run_suite.py \
        --backend nccl_ep --nccl-ep-mode "$mode" --checks "$checks" --agreement $agreement \
        ${TE_EP_SUITE_CASES:+-k $TE_EP_SUITE_CASES}
    done
    want smoke && run "nccl_ep smoke W=$w mode=$mode" "$LOG/smoke.log" \
      timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" \
      tests/gpu/smoke_nccl_ep.py --nccl-ep-mode "$mode"
  done
done
if [ "$largest" -gt 0 ] && want soak; then
  for mode in $MODES; do
    run "soak 1000 steps W=$largest nccl_ep mode=$mode" "$LOG/soak.log" \
      timeout 900 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node="$largest" tests/gpu/soak.py --steps 1000 --nccl-ep-mode "$mode"
  done
fi
# Each fault case in fresh processes with a hard wall-clock limit; fails on a behaviour
# other than the one declared in tests/faults/cases.py (docs/ops.md, "Faults and bad input").
# On one GPU: at W=1 (the cases marked one_rank; the faulty rank's side only).
fw=$(( ngpu >= 2 ? 2 : 1 ))
# The harness's fault-free warm-up (NCCL EP's kernels for the cases' shapes, cached on disk) runs
# once per nccl_ep mode; TE_EP_FAULT_PG_TIMEOUT (seconds; --quick: 10) sets the cases' process-group
# timeout, which is what a lost-rank case waits.
if want faults; then
  for mode in $MODES; do
    warmed=""
    for checks in $CHECKS; do
      run "faults W=$fw nccl_ep mode=$mode checks=$checks" "$LOG/faults.log" \
        timeout 1200 "$PY" -m tests.faults --backend nccl_ep --world-size $fw --nccl-ep-mode "$mode" \
        --checks "$checks" -v $warmed --summary "$LOG/faults_summary.txt" \
        ${TE_EP_FAULT_PG_TIMEOUT:+--pg-timeout $TE_EP_FAULT_PG_TIMEOUT} \
        ${TE_EP_FAULT_CASES:+-k $TE_EP_FAULT_CASES}
      warmed="--no-warmup"
    done
  done
fi
want perm && run "permutation CUDA tests" "$LOG/permutation.log" timeout 900 "$PY" -m pytest -q tests/test_permutation.py -k cuda
want fp8 && run "FP8 CUDA tests" "$LOG/fp8.log" \
  timeout 900 "$PY" -m pytest -q tests/test_fp8_ops.py "tests/test_moe_fp8.py::test_fp8_dispatch_layer_gpu"
want overlap && run "overlap GPU tests" "$LOG/overlap.log" \
  timeout 900 "$PY" -m pytest -q "tests/test_moe_overlap.py::test_overlap_layer_matches_sequential_gpu" \
    "tests/test_moe_overlap.py::test_overlap_layer_in_a_cuda_graph_gpu"
want watchdog && run "watchdog GPU tests" "$LOG/watchdog.log" timeout 900 "$PY" -m pytest -q tests/gpu/test_watchdog.py
echo
printf '%s\n' "${summary[@]}"
echo "total ${SECONDS}s"
exit $status
