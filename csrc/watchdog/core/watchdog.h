// A watchdog for te_ep's ops that wait on other ranks.
//
// NCCL EP 0.2.0's high-throughput kernels (the ones te_ep runs) spin on the
// device until every peer's data has arrived, with no time limit: its
// `timeout_ns` only bounds the low-latency kernels. A rank that exits or
// stalls in the middle of a step therefore leaves the others spinning forever.
// The host waits with them wherever it waits for the GPU: inside an op (the
// synchronous check mode's agreement, a copy to the host, a CUDA call that
// must wait for the device, such as loading a kernel on first use) or after
// it (`.item()`, a synchronize, the caching allocator). torch's
// ProcessGroupNCCL has the same problem for its own collectives and solves it
// with a watchdog thread; this is the counterpart for te_ep's ops.
//
// An op's limit counts from the moment its host thread enters it (`Op`,
// registered before anything in the op can wait): the op must return on the
// host, and the GPU work it queued (`Op::watch_stream`, a CUDA event recorded
// on its stream) must finish, within `timeout_ms` of that moment. One thread
// per process checks the deadlines and makes no CUDA call, so it fires even
// while the CUDA driver blocks every thread that calls it (as it can while a
// kernel does not end); in CUDA builds a second thread queries the events,
// and a marker whose query has not come back by its deadline counts as not
// finished. When a limit passes, the message names the op and what the
// caller labelled it with (handle, group, rank), and then, by the action
// chosen with TE_EP_WATCHDOG, the process ends at once with _exit (exit code
// kExitCode, the default; no exit handler or destructor runs, since those
// would wait for the GPU too: a spinning kernel can't be stopped and the CUDA
// context can't be recovered, so the job launcher must restart the job), or
// the message is only printed ("warn"), or nothing is watched at all ("off").
//
// Framework-free. The host side builds everywhere (a CPU build watches host
// waits only); the GPU side needs the CUDA runtime. Markers are never
// recorded under CUDA graph capture (a graph's replays are not watched).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#if TE_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace te_ep {
namespace watchdog {

// Exit code of a process the watchdog ends (EX_SOFTWARE in sysexits.h).
constexpr int kExitCode = 70;

// What a firing watchdog does; TE_EP_WATCHDOG=exit|warn|off, read once.
enum class Action { kExit, kWarn, kOff };

// The action TE_EP_WATCHDOG asks for; throws std::invalid_argument naming
// the variable and the accepted values for anything else.
Action action();
const char* action_name(Action action);

// One watched op, from its entry on the host until the object is destroyed
// (the op returned or threw) and its GPU work has finished.
class Op {
 public:
  // Registers an op entered now, with a limit of `timeout_ms` (> 0). `what`
  // names it for the message, e.g. "te_ep.dispatch on handle 3 of group 'ep'
  // (rank 1 of 2)"; it is shared, never copied, so that a caller entering
  // the same op on every step builds the name once. nullptr under action
  // kOff, for timeout_ms <= 0, or once the process is exiting.
  static std::unique_ptr<Op> enter(int64_t timeout_ms, std::shared_ptr<const std::string> what);
  ~Op();
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

#if TE_EP_WITH_CUDA
  // Records a marker on `stream` (of `device`) after the op queued its work
  // there: that work must finish within the op's limit, counted from its
  // entry. No-op while `stream` is capturing a CUDA graph.
  void watch_stream(cudaStream_t stream, int device);
#endif

 private:
  Op(uint64_t id, std::chrono::steady_clock::time_point entered, int64_t timeout_ms,
     std::shared_ptr<const std::string> what);

  uint64_t id_;
  std::chrono::steady_clock::time_point entered_;
  int64_t timeout_ms_;
  std::shared_ptr<const std::string> what_;
};

// Stops watching (the process is exiting: the CUDA runtime may already be
// unloading). Pending ops and markers are dropped.
void stop();

// Ops inside their host part plus markers pending now (tests and diagnostics).
int64_t pending();

// How many times a watchdog fired in this process (kWarn keeps running).
int64_t fired();

}  // namespace watchdog
}  // namespace te_ep
