#!/usr/bin/env bash
# The whole GPU suite in one command, on a machine with CUDA GPUs:
#   bash tests/gpu/run_all.sh            # logs under ${TE_EP_LOG_DIR:-gpu_logs}, one per part
# Runs, for every world size W in ${TE_EP_WORLD_SIZES:-2 4} that the machine has GPUs for:
# the shared cases on the reference and nccl_ep backends (nccl_ep also against
# the reference), the nccl_ep smoke test, the 1000-step soak and the fault-injection cases
# (tests/faults) on nccl_ep (the fault cases at W=1 where no W fits: on one GPU).
# Every nccl_ep part runs once per nccl_ep mode in ${TE_EP_NCCL_EP_MODES:-staged zero_copy}, the
# suite and the faults once per check mode in ${TE_EP_CHECKS:-local device synchronous} as well.
# Then the permutation CUDA tests, the FP8 tests (quantize kernels, the FP8-dispatch MoE layer)
# (2 GPUs) and the overlap tests (communication stream vs sequential layer, bitwise, with a
# delayed stream; 2 GPUs), and the watchdog tests (one GPU: an nccl_ep op stalled behind a spinning
# kernel ends the process).
# Parts share the machine: each runs on GPUs of its own (CUDA_VISIBLE_DEVICES), started as soon
# as enough are free, those that need the most GPUs first; on 4 GPUs two W=2 parts run side by
# side, and the one-GPU parts beside them. A part's steps (the fault cases' check modes, which
# share one kernel-cache warm-up) run in order.
# Prints a line per step as it ends and the summary at the end (its exit status, seconds and
# last result line; in queue order) and exits non-zero if any step failed; the fault part also
# writes $LOG/faults_summary.txt, one line per case and variant: which limit ended each rank,
# after how long. Stopped (a caller's time limit, Ctrl-C), it ends every running part with
# every process below it, torchrun's workers included (tests/gpu/process_tree.sh), so a cut run
# leaves the GPUs free for the next, and prints the summary of the steps that ended.
# TE_EP_PARTS (default "suite smoke soak perm faults fp8 overlap watchdog") selects parts, e.g. to
# split the run across shorter commands.
#   bash tests/gpu/run_all.sh --quick    # every path once: each nccl_ep mode x check mode on a few
#                                        # cases (bf16 and FP8, eager, compiled and CUDA graph, their
#                                        # errors), the smoke test, a few fault cases at a 10 s process-
#                                        # group timeout (a rank that exits mid-step: the watchdog's host
#                                        # side, measured at W=2 and W=4), the
#                                        # watchdog's GPU side (tests/gpu/test_watchdog.py); no soak
#                                        # (about 10 minutes at W=2 with a warm kernel cache)
# NCCL EP compiles its kernels per shape and world size on first use (NCCL_EP_JIT_CACHE_DIR):
# on a fresh machine, unpack the cache a run left (tar of the directory: the --quick suite's
# kernels at W=2 are 0.8 MB compressed, every shape of the suite, smoke and soak at W=2 and W=4
# 3.5 MB) before starting, or the nccl_ep suite's first check mode pays its compilation (about
# 150 s for the --quick cases at W=2, about 100 s for the whole suite at W=4; docs/results/).
# Parts side by side write the cache safely (NCCL EP writes each kernel to a temporary file and
# renames it). TE_EP_KERNEL_CACHE=FILE keeps the cache in FILE (a .tar.gz) across machines: FILE,
# where it exists, is unpacked into NCCL_EP_JIT_CACHE_DIR (set to $LOG/nccl_ep_jit where unset)
# before the first part, and FILE is rewritten with the whole cache when the run ends or is
# stopped, so the next machine starts warm (a cold cache cost about 250 s per nccl_ep mode at W=4).
if [ "${1:-}" = "--quick" ]; then
  export TE_EP_SUITE_CASES=${TE_EP_SUITE_CASES:-"routing_exact fp8_dispatch_exact cuda_graph check_modes device_checks_op_arguments bad_input_tokens_dtype capacity_overflow"}
  export TE_EP_FAULT_CASES=${TE_EP_FAULT_CASES:-"expert_id_out_of_range tokens_dtype_one_rank rank_exits_mid_step"}
  export TE_EP_FAULT_PG_TIMEOUT=${TE_EP_FAULT_PG_TIMEOUT:-10}
  export TE_EP_WORLD_SIZES=${TE_EP_WORLD_SIZES:-2}
  export TE_EP_PARTS=${TE_EP_PARTS:-nccl_suite smoke faults fp8 overlap watchdog}
fi
set -uo pipefail
cd "$(dirname "$0")/../.."
# Stopped by a time limit or Ctrl-C, the script ends the running parts' whole process trees
# (torchrun's workers included) instead of leaving them on the GPUs, then calls after_stop.
source tests/gpu/process_tree.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${TE_EP_LOG_DIR:-gpu_logs}
mkdir -p "$LOG"
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if ! [ "$ngpu" -ge 1 ] 2>/dev/null; then
  echo "no CUDA GPU visible: nothing to run"
  exit 1
fi
# The GPUs the parts share, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs).
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
  GPUS=("${GPUS[@]:0:$ngpu}")
else
  GPUS=($(seq 0 $((ngpu - 1))))
fi
PARTS=" ${TE_EP_PARTS:-suite smoke soak perm faults fp8 overlap watchdog} "
MODES=${TE_EP_NCCL_EP_MODES:-staged zero_copy}
CHECKS=${TE_EP_CHECKS:-local device synchronous}
want() { [[ "$PARTS" == *" $1 "* ]]; }
SUM=$(mktemp -d "$LOG/.summary.XXXXXX")  # a part's summary lines, one file per part
CACHE=${TE_EP_KERNEL_CACHE:-}
if [ -n "$CACHE" ]; then
  export NCCL_EP_JIT_CACHE_DIR=${NCCL_EP_JIT_CACHE_DIR:-$LOG/nccl_ep_jit}
  mkdir -p "$NCCL_EP_JIT_CACHE_DIR"
  if [ -e "$CACHE" ] && ! tar xzf "$CACHE" -C "$NCCL_EP_JIT_CACHE_DIR"; then
    echo "TE_EP_KERNEL_CACHE must name a .tar.gz that run_all.sh wrote (or a file not there yet), got '$CACHE'"
    rm -rf "$SUM"
    exit 1
  fi
fi
# The cache back into TE_EP_KERNEL_CACHE, through a temporary file (a stopped run keeps the old one whole).
save_cache() {
  [ -n "$CACHE" ] || return 0
  if tar czf "$CACHE.tmp" -C "$NCCL_EP_JIT_CACHE_DIR" . && mv "$CACHE.tmp" "$CACHE"; then
    echo "kernel cache saved to $CACHE"
  else
    echo "kernel cache not saved to $CACHE"
  fi
}

# run <name> <log> <command...>: one step of a part, its output appended to <log>; its summary
# line is printed and kept in the part's file ($SUM/$PART). A part's steps are named after the
# part's label ($LABEL_OF_PART).
run() {
  local name=$1 log=$2
  shift 2
  echo "=== $name (GPUs $CUDA_VISIBLE_DEVICES)" | tee -a "$log"
  local t0=$SECONDS
  run_in_tree "$@" >>"$log" 2>&1
  local rc=$?
  local last line
  last=$(grep -E "^[0-9]+ passed, [0-9]+ failed|passed|failed" "$log" | tail -1)
  line=$(printf '%-50s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$last")
  echo "$line" >> "$SUM/$PART"
  echo "--- $line"
  [ $rc -eq 0 ] || touch "$SUM/failed"
  return $rc
}

# The parts. Each but pytest_part takes its world size first.
suite_reference() {
  run "$LABEL_OF_PART" "$LOG/suite_W$1_reference.log" \
    timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$1" tests/gpu/run_suite.py --backend reference
}
suite_nccl_ep() {  # W mode checks
  # checks=synchronous: the cases that need every rank to raise in the op (the other
  # modes run every case but those, on good steps and their own error cases).
  local agreement=include
  [ "$3" = synchronous ] && [ "$1" -ge 2 ] && agreement=only
  run "$LABEL_OF_PART" "$LOG/suite_W$1_$2_$3.log" \
    timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$1" tests/gpu/run_suite.py \
    --backend nccl_ep --nccl-ep-mode "$2" --checks "$3" --agreement $agreement \
    ${TE_EP_SUITE_CASES:+-k $TE_EP_SUITE_CASES}
}
smoke() {  # W mode
  run "$LABEL_OF_PART" "$LOG/smoke_W$1_$2.log" \
    timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$1" tests/gpu/smoke_nccl_ep.py --nccl-ep-mode "$2"
}
soak() {  # W mode
  run "$LABEL_OF_PART" "$LOG/soak_W$1_$2.log" \
    timeout 900 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$1" tests/gpu/soak.py --steps 1000 --nccl-ep-mode "$2"
}
# Each fault case in fresh processes with a hard wall-clock limit; fails on a behaviour
# other than the one declared in tests/faults/cases.py (docs/ops.md, "Faults and bad input").
# At W=1 (one GPU): the cases marked one_rank (the faulty rank's side only). The harness's
# fault-free warm-up (NCCL EP's kernels for the cases' shapes, cached on disk) runs once per
# part, before its first check mode; TE_EP_FAULT_PG_TIMEOUT (seconds; --quick: 10) sets the
# cases' process-group timeout, which is what a lost-rank case waits.
faults() {  # W mode
  local checks warmed=""
  for checks in $CHECKS; do
    run "$LABEL_OF_PART checks=$checks" "$LOG/faults_W$1_$2_$checks.log" \
      timeout 1200 "$PY" -m tests.faults --backend nccl_ep --world-size "$1" --nccl-ep-mode "$2" \
      --checks "$checks" -v $warmed --summary "$LOG/faults_summary.txt" \
      ${TE_EP_FAULT_PG_TIMEOUT:+--pg-timeout $TE_EP_FAULT_PG_TIMEOUT} \
      ${TE_EP_FAULT_CASES:+-k $TE_EP_FAULT_CASES}
    warmed="--no-warmup"
  done
}
pytest_part() {  # log pytest-args...
  local log=$1
  shift
  run "$LABEL_OF_PART" "$log" timeout 900 "$PY" -m pytest -q "$@"
}

# The queue: part <gpus> <label> <function> <args...> (gpus: at most the machine's).
NEED=() LABEL=() BODY=()
part() {
  NEED+=("$(( $1 < ngpu ? $1 : ngpu ))")
  LABEL+=("$2")
  shift 2
  BODY+=("$(printf '%q ' "$@")")
}
fault_ws=""
for w in ${TE_EP_WORLD_SIZES:-2 4}; do  # 1: the one-rank cases of run_suite.py (one GPU)
  [ "$w" -le "$ngpu" ] || continue
  fault_ws="$fault_ws $w"
  want suite && [ "$w" -ge 2 ] && part "$w" "suite W=$w backend=reference" suite_reference "$w"
  for mode in $MODES; do
    for checks in $CHECKS; do
      { want suite || want nccl_suite; } && part "$w" "suite W=$w nccl_ep mode=$mode checks=$checks" suite_nccl_ep "$w" "$mode" "$checks"
    done
    want smoke && part "$w" "nccl_ep smoke W=$w mode=$mode" smoke "$w" "$mode"
    want soak && part "$w" "soak 1000 steps W=$w nccl_ep mode=$mode" soak "$w" "$mode"
  done
done
if want faults; then
  for w in ${fault_ws:-1}; do
    for mode in $MODES; do part "$w" "faults W=$w nccl_ep mode=$mode" faults "$w" "$mode"; done
  done
fi
want perm && part 1 "permutation CUDA tests" pytest_part "$LOG/permutation.log" tests/test_permutation.py -k cuda
want fp8 && part 2 "FP8 CUDA tests" pytest_part "$LOG/fp8.log" \
  tests/test_fp8_ops.py "tests/test_moe_fp8.py::test_fp8_dispatch_layer_gpu"
want overlap && part 2 "overlap GPU tests" pytest_part "$LOG/overlap.log" \
  "tests/test_moe_overlap.py::test_overlap_layer_matches_sequential_gpu" \
  "tests/test_moe_overlap.py::test_overlap_layer_in_a_cuda_graph_gpu"
want watchdog && part 1 "watchdog GPU tests" pytest_part "$LOG/watchdog.log" tests/gpu/test_watchdog.py

print_summary() {
  local j
  echo
  for j in "${!BODY[@]}"; do
    [ -s "$SUM/$j" ] && cat "$SUM/$j"
    [ -e "$SUM/$j.done" ] || printf '%-50s not run to its end\n' "${LABEL[$j]}"
  done
  echo "total ${SECONDS}s"
}
# After the last part, and when the run is stopped (process_tree.sh calls it).
after_stop() { print_summary; rm -rf "$SUM"; save_cache; }

# The scheduler: start every queued part whose GPUs are free (most GPUs first, then queue
# order), each in a subshell of its own with its CUDA_VISIBLE_DEVICES; poll for ends.
FREE=("${GPUS[@]}")
declare -A HELD=()  # pid of a running part -> its GPUs
pending=()
for n in $(seq "$ngpu" -1 1); do
  for j in "${!NEED[@]}"; do [ "${NEED[$j]}" -eq "$n" ] && pending+=("$j"); done
done
while [ ${#pending[@]} -gt 0 ] || [ ${#HELD[@]} -gt 0 ]; do
  rest=()
  for j in "${pending[@]}"; do
    n=${NEED[$j]}
    if [ "$n" -le "${#FREE[@]}" ]; then
      gpus=$(IFS=,; echo "${FREE[*]:0:$n}")
      FREE=("${FREE[@]:$n}")
      (  # stopped, a part ends its own tree first: a part that died at once would orphan its steps
        trap 'stop_tree $BASHPID; exit 143' TERM INT
        export CUDA_VISIBLE_DEVICES=$gpus PART=$j LABEL_OF_PART=${LABEL[$j]}
        eval "${BODY[$j]}"
        touch "$SUM/$j.done"
      ) &
      HELD[$!]=$gpus
    else
      rest+=("$j")
    fi
  done
  pending=("${rest[@]}")
  ended=0
  for pid in "${!HELD[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"
    IFS=, read -ra g <<< "${HELD[$pid]}"
    FREE+=("${g[@]}")
    unset "HELD[$pid]"
    ended=1
  done
  [ $ended -eq 1 ] || { sleep 0.5 & wait $!; }  # a wait that the traps interrupt
done
status=0
[ -e "$SUM/failed" ] && status=1
after_stop
exit $status
