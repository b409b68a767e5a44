#!/usr/bin/env bash
# The whole GPU suite in one command, on a machine with CUDA GPUs:
#   bash tests/gpu/run_all.sh            # logs under ${TE_EP_LOG_DIR:-gpu_logs}
# Runs, for every world size W in ${TE_EP_WORLD_SIZES:-2 4} that the machine has GPUs for:
# the shared cases on the reference and nccl_ep backends (nccl_ep also against
# the reference), the nccl_ep smoke test, and the 1000-step soak at the largest
# W; the fault-injection cases (tests/faults) at W=2 (W=1 on one GPU) on nccl_ep in its three check modes
# (default, TE_EP_CHECK_ROUTING=1, TE_EP_DEVICE_CHECKS=1). Every nccl_ep part runs once per
# nccl_ep mode in ${TE_EP_NCCL_EP_MODES:-staged zero_copy}. Then the
# permutation CUDA tests, the FP8 tests (quantize kernels, the FP8-dispatch MoE layer) and the
# overlap tests (communication stream vs sequential layer, bitwise, with a delayed stream), and the
# watchdog tests (one GPU: an nccl_ep op stalled behind a spinning kernel ends the process).
# Prints a summary line per part and exits
# non-zero if any part failed. TE_EP_PARTS (default "suite smoke soak perm faults fp8 overlap watchdog")
# selects parts, e.g. to split the run across shorter commands.
set -uo pipefail
cd "$(dirname "$0")/../.."
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
  "$@" >>"$log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "^[0-9]+ passed, [0-9]+ failed|passed|failed" "$log" | tail -1)
  summary+=("$(printf '%-44s rc=%-3s %s' "$name" "$rc" "$last")")
  [ $rc -eq 0 ] || status=1
}
largest=0
for w in ${TE_EP_WORLD_SIZES:-2 4}; do
  [ "$w" -le "$ngpu" ] || continue
  largest=$w
  want suite && run "suite W=$w backend=reference" "$LOG/suite.log" \
    timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" tests/gpu/run_suite.py --backend reference
  for mode in $MODES; do
    want suite && run "suite W=$w backend=nccl_ep mode=$mode" "$LOG/suite.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" \
      tests/gpu/run_suite.py --backend nccl_ep
    # The error-agreement cases, on nccl_ep's checking mode.
    want suite && run "suite W=$w nccl_ep mode=$mode TE_EP_CHECK_ROUTING=1" "$LOG/suite.log" \
      env TE_EP_NCCL_EP_MODE="$mode" TE_EP_CHECK_ROUTING=1 timeout 900 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node="$w" tests/gpu/run_suite.py --backend nccl_ep --agreement only
    # Every case with every handle in the device check mode (each op's agreement all-reduce
    # on good steps; routing_guard, the default mode's case, is skipped).
    want suite && run "suite W=$w nccl_ep mode=$mode TE_EP_DEVICE_CHECKS=1" "$LOG/suite.log" \
      env TE_EP_NCCL_EP_MODE="$mode" TE_EP_DEVICE_CHECKS=1 timeout 900 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node="$w" tests/gpu/run_suite.py --backend nccl_ep
    want smoke && run "nccl_ep smoke W=$w mode=$mode" "$LOG/smoke.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" \
      tests/gpu/smoke_nccl_ep.py
  done
done
if [ "$largest" -gt 0 ] && want soak; then
  for mode in $MODES; do
    run "soak 1000 steps W=$largest nccl_ep mode=$mode" "$LOG/soak.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 900 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node="$largest" tests/gpu/soak.py --steps 1000
  done
fi
# Each fault case in fresh processes with a hard wall-clock limit; fails on a behaviour
# other than the one declared in tests/faults/cases.py (docs/ops.md, "Faults and bad input").
# On one GPU: at W=1 (the cases marked one_rank; the faulty rank's side only).
fw=$(( ngpu >= 2 ? 2 : 1 ))
if want faults; then
  for mode in $MODES; do
    run "faults W=$fw nccl_ep mode=$mode" "$LOG/faults.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 1200 "$PY" -m tests.faults --backend nccl_ep --world-size $fw -v
    run "faults W=$fw nccl_ep mode=$mode TE_EP_CHECK_ROUTING=1" "$LOG/faults.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 1200 "$PY" -m tests.faults --backend nccl_ep --world-size $fw \
      --check-routing -v
    run "faults W=$fw nccl_ep mode=$mode TE_EP_DEVICE_CHECKS=1" "$LOG/faults.log" \
      env TE_EP_NCCL_EP_MODE="$mode" timeout 1200 "$PY" -m tests.faults --backend nccl_ep --world-size $fw \
      --device-checks -v
  done
fi
want perm && run "permutation CUDA tests" "$LOG/permutation.log" timeout 900 "$PY" -m pytest -q tests/test_permutation.py -k cuda
want fp8 && run "FP8 CUDA tests" "$LOG/fp8.log" \
  timeout 900 "$PY" -m pytest -q tests/test_fp8_ops.py "tests/test_moe.py::test_fp8_dispatch_layer_gpu"
want overlap && run "overlap GPU tests" "$LOG/overlap.log" \
  timeout 900 "$PY" -m pytest -q "tests/test_moe.py::test_overlap_layer_matches_sequential_gpu" \
    "tests/test_moe.py::test_overlap_layer_in_a_cuda_graph_gpu"
want watchdog && run "watchdog GPU tests" "$LOG/watchdog.log" timeout 900 "$PY" -m pytest -q tests/gpu/test_watchdog.py
echo
printf '%s\n' "${summary[@]}"
exit $status
