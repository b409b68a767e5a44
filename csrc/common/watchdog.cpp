// See watchdog.h.
#include "common/watchdog.h"

#if TE_EP_WITH_CUDA

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace te_ep {
namespace watchdog {
namespace {

using Clock = std::chrono::steady_clock;

// How often the thread looks at the markers: a hung op is reported at most
// this long after its limit.
constexpr auto kPollPeriod = std::chrono::milliseconds(100);

struct Marker {
  cudaEvent_t event = nullptr;
  int device = 0;
  Clock::time_point launched;
  int64_t timeout_ms = 0;
  std::string what;
  bool reported = false;  // kWarn reports a marker once
};

struct State {
  std::mutex mu;
  std::condition_variable wake;
  std::map<cudaStream_t, std::deque<Marker>> streams;
  std::map<int, std::vector<cudaEvent_t>> spare_events;  // per device, for reuse
  std::set<int> broken_devices;  // a CUDA error there: nothing to watch any more
  bool started = false;
  bool stopping = false;
  int64_t fired = 0;
};

// Leaked: the thread may still run while static destructors do.
State& state() {
  static State* s = new State();
  return *s;
}

Action parse_action() {
  const char* raw = std::getenv("TE_EP_WATCHDOG");
  const std::string value = raw == nullptr ? "" : raw;
  if (value.empty() || value == "exit" || value == "1") return Action::kExit;
  if (value == "warn") return Action::kWarn;
  if (value == "off" || value == "0") return Action::kOff;
  throw std::invalid_argument("TE_EP_WATCHDOG must be 'exit' (the default), 'warn' or 'off', got '" + value + "'");
}

std::string describe(const Marker& m, Clock::time_point now, Action act) {
  const double waited = std::chrono::duration<double>(now - m.launched).count();
  std::ostringstream msg;
  msg.setf(std::ios::fixed);
  msg.precision(1);
  msg << "te_ep watchdog: " << m.what << " has not finished on GPU " << m.device << " " << waited
      << " s after it was launched (limit " << static_cast<double>(m.timeout_ms) / 1000.0
      << " s: EpGroup(timeout=...), by default the process group's timeout). NCCL EP's high-throughput kernels "
         "wait for the other ranks without a time limit, so another rank of the group most likely exited, stalled "
         "or never reached this op (or this stream had that much other work queued ahead of it). A kernel that "
         "does not end can't be stopped, and the CUDA context of this process can't be used again. ";
  if (act == Action::kExit) {
    msg << "Ending the process with exit code " << kExitCode
        << " so that the job launcher (torchrun) can restart the job from its last checkpoint; "
           "TE_EP_WATCHDOG=warn only prints this message, TE_EP_WATCHDOG=off disables the watchdog.";
  } else {
    msg << "TE_EP_WATCHDOG=warn: the process goes on, and its next wait for the GPU will not return.";
  }
  return msg.str();
}

// Called with the lock held.
void poll_locked(State& s, Action act) {
  const auto now = Clock::now();
  for (auto& [stream, queue] : s.streams) {
    (void)stream;
    while (!queue.empty()) {
      Marker& m = queue.front();
      if (s.broken_devices.count(m.device) == 0) {
        const cudaError_t status = cudaEventQuery(m.event);
        if (status == cudaErrorNotReady) {
          if (!m.reported && now - m.launched >= std::chrono::milliseconds(m.timeout_ms)) {
            const std::string message = describe(m, now, act);
            ++s.fired;
            std::fprintf(stderr, "%s\n", message.c_str());
            std::fflush(stderr);
            if (act == Action::kExit) std::_Exit(kExitCode);
            m.reported = true;
          }
          break;  // later markers of this stream can't have completed
        }
        if (status == cudaSuccess) {
          s.spare_events[m.device].push_back(m.event);
        } else {
          // A CUDA error (the context is broken, or the runtime is unloading):
          // it surfaces in the process's own next CUDA call; stop watching
          // this device and leave its events alone.
          (void)cudaGetLastError();
          s.broken_devices.insert(m.device);
        }
      }
      queue.pop_front();
    }
  }
}

void run(Action act) {
  // Relaxed: this thread's event queries must never count as unsafe calls
  // against a CUDA graph that another thread captures in global mode (torch's
  // default), which would invalidate that capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  while (!s.stopping) {
    s.wake.wait_for(lock, kPollPeriod, [&] { return s.stopping; });
    if (s.stopping) break;
    poll_locked(s, act);
  }
}

}  // namespace

Action action() {
  static const Action value = parse_action();
  return value;
}

const char* action_name(Action act) {
  switch (act) {
    case Action::kExit: return "exit";
    case Action::kWarn: return "warn";
    case Action::kOff: return "off";
  }
  return "?";
}

void watch(cudaStream_t stream, int device, int64_t timeout_ms, const std::string& what) {
  const Action act = action();
  if (act == Action::kOff || timeout_ms <= 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (capture != cudaStreamCaptureStatusNone) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stopping || s.broken_devices.count(device) != 0) return;
  cudaEvent_t event = nullptr;
  auto& spare = s.spare_events[device];
  if (!spare.empty()) {
    event = spare.back();
    spare.pop_back();
  } else if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    // The op itself was launched; its own errors surface where torch checks them.
    (void)cudaGetLastError();
    return;
  }
  if (cudaEventRecord(event, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    spare.push_back(event);
    return;
  }
  s.streams[stream].push_back(Marker{event, device, Clock::now(), timeout_ms, what});
  if (!s.started) {
    s.started = true;
    std::thread(run, act).detach();
  }
}

void stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stopping = true;
  s.streams.clear();
  s.wake.notify_all();
}

int64_t pending() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  int64_t total = 0;
  for (const auto& entry : s.streams) total += static_cast<int64_t>(entry.second.size());
  return total;
}

int64_t fired() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.fired;
}

}  // namespace watchdog
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA
