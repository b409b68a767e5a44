// A host-side watchdog for GPU work that waits on other ranks.
//
// NCCL EP 0.2.0's high-throughput kernels (the ones te_ep runs) spin on the
// device until every peer's data has arrived, with no time limit: its
// `timeout_ns` only bounds the low-latency kernels. A rank that exits or
// stalls in the middle of a step therefore leaves the others spinning forever,
// and a host that then waits for the GPU (`.item()`, a synchronize, the
// caching allocator) blocks with it. torch's ProcessGroupNCCL has the same
// problem for its own collectives and solves it with a watchdog thread; this
// is the counterpart for te_ep's ops.
//
// After each op the caller records a completion marker (`watch`). One thread
// per process polls the oldest marker of each stream (CUDA work on a stream
// completes in order). A marker still pending `timeout_ms` after its op was
// launched fires: the message names the op and what the caller labelled it
// with (handle, group, rank), and then, by the action chosen with
// TE_EP_WATCHDOG, the process ends (exit code kExitCode, the default: a
// spinning kernel can't be stopped and the CUDA context can't be recovered,
// so the job launcher must restart the job), or the message is only printed
// ("warn"), or nothing is watched at all ("off").
//
// Framework-free: the CUDA runtime only. Markers are never recorded under
// CUDA graph capture (a graph's replays are not watched).
#pragma once

#if TE_EP_WITH_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

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

// Records a marker on `stream` (of `device`) after an op launched there. The
// op counts as hung when the marker is still pending `timeout_ms` (> 0) after
// this call. `what` names the op for the message, e.g. "te_ep.dispatch on
// handle 3 of group 'ep' (rank 1 of 2)". No-op under action kOff, while
// `stream` is capturing a CUDA graph, or once the process is exiting.
void watch(cudaStream_t stream, int device, int64_t timeout_ms, const std::string& what);

// Stops watching (the process is exiting: the CUDA runtime may already be
// unloading). Pending markers are dropped.
void stop();

// Markers pending now, summed over streams (tests and diagnostics).
int64_t pending();

// How many times a watchdog fired in this process (kWarn keeps running).
int64_t fired();

}  // namespace watchdog
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA
