# Sourced by tests/gpu/run_all.sh: a part that is still running when the script is stopped
# (its caller's time limit, Ctrl-C) ends with its whole process tree. torchrun starts each
# worker in a session of its own, so a signal to the script's process group does not reach the
# workers, and a torchrun that dies first leaves them behind, holding the GPUs.
#
#   run_in_tree CMD...   runs CMD in the background and waits for it (a wait that a trapped
#                        signal interrupts), returning its exit status
#   stop_tree [PID]      TERM to every process below PID (default: this shell), all at once,
#                        then KILL to those still alive 5 s later

# Every process below $1, deepest first (a parent's pid after its children's).
descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "$child"
    echo "$child"
  done
}

stop_tree() {
  local root=${1:-$$} pids alive pid
  # The whole tree is listed before any signal: a torchrun that ends first would leave its
  # workers to init, out of reach of a later listing.
  pids=$(descendants "$root")
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null
  for _ in $(seq 50); do  # 5 s for the processes to end on TERM
    alive=""
    for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
    [ -n "$alive" ] || return 0
    sleep 0.1
  done
  kill -KILL $alive 2>/dev/null
  return 0
}

run_in_tree() {
  "$@" &
  local pid=$!
  wait "$pid"
}

# On TERM or INT: stop every part, call the script's after_stop if it defines one (run_all.sh
# prints the summary of the steps that ended), then end with the conventional status
# (128 + signal).
stopped() {  # status, message
  trap - TERM INT
  echo "$2: ending every process of the running part" >&2
  stop_tree $$
  ! declare -F after_stop >/dev/null || after_stop
  exit "$1"
}
trap 'stopped 143 stopped' TERM
trap 'stopped 130 interrupted' INT
