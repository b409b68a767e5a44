// See watchdog.h.
#include "watchdog/core/watchdog.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if TE_EP_WITH_CUDA
#include <deque>
#include <set>
#endif

namespace te_ep {
namespace watchdog {
namespace {

using Clock = std::chrono::steady_clock;

#if TE_EP_WITH_CUDA
// How often the poller queries the markers: GPU work that finished is seen
// at most this late.
constexpr auto kPollPeriod = std::chrono::milliseconds(100);
// A query of the markers that has not come back in this long is blocked by
// the CUDA driver: the markers past their deadline then count as not finished.
constexpr auto kQueryStuck = std::chrono::milliseconds(1000);
#endif
// The longest the checker sleeps when no deadline is nearer (it is woken for
// every new op, so this only bounds the cost of a lost wake-up).
constexpr auto kIdlePeriod = std::chrono::milliseconds(500);

// An op whose host thread is inside it.
struct HostOp {
  Clock::time_point entered;
  int64_t timeout_ms = 0;
  std::shared_ptr<const std::string> what;
  long thread_id = 0;
  bool reported = false;  // kWarn reports an op once
};

#if TE_EP_WITH_CUDA
// The completion of an op's GPU work on one stream.
struct Marker {
  uint64_t id = 0;
  cudaEvent_t event = nullptr;
  int device = 0;
  Clock::time_point entered;  // the op's entry on the host: its limit counts from there
  int64_t timeout_ms = 0;
  std::shared_ptr<const std::string> what;
  Clock::time_point seen_pending;  // when the last query that found it pending started
  bool reported = false;
};
#endif

struct State {
  std::mutex mu;  // never held across a CUDA call
  std::condition_variable wake_checker;
  uint64_t next_id = 1;
  std::map<uint64_t, HostOp> ops;
  bool checker_started = false;
  Clock::time_point checker_wakes_at = Clock::time_point::max();
  bool stopping = false;
  int64_t fired = 0;
#if TE_EP_WITH_CUDA
  std::condition_variable wake_poller;
  std::map<cudaStream_t, std::deque<Marker>> streams;
  std::map<int, std::vector<cudaEvent_t>> spare_events;  // per device, for reuse
  std::set<int> broken_devices;  // a CUDA error there: nothing to watch any more
  bool poller_started = false;
  bool querying = false;  // the poller is inside its CUDA queries, since query_started
  Clock::time_point query_started;
#endif
};

// Leaked: the threads may still run while static destructors do.
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

Clock::time_point deadline(Clock::time_point entered, int64_t timeout_ms) {
  return entered + std::chrono::milliseconds(timeout_ms);
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void start_message(std::ostringstream& msg, const std::string& what) {
  msg.setf(std::ios::fixed);
  msg.precision(1);
  msg << "te_ep watchdog: " << what;
}

void limit(std::ostringstream& msg, int64_t timeout_ms) {
  msg << " (limit " << static_cast<double>(timeout_ms) / 1000.0
      << " s: EpGroup(timeout=...), by default the process group's timeout). ";
}

void ending(std::ostringstream& msg, Action act) {
  if (act == Action::kExit) {
    msg << "Ending the process now (_exit, no exit handlers) with exit code " << kExitCode
        << " so that the job launcher (torchrun) can restart the job from its last checkpoint; "
           "TE_EP_WATCHDOG=warn only prints this message, TE_EP_WATCHDOG=off disables the watchdog.";
  } else {
    msg << "TE_EP_WATCHDOG=warn: the process goes on, and its next wait for the GPU will not return.";
  }
}

std::string host_message(const HostOp& op, Clock::time_point now, Action act) {
  std::ostringstream msg;
  start_message(msg, *op.what);
  msg << " has not returned on the host " << seconds(now - op.entered) << " s after it was entered";
  limit(msg, op.timeout_ms);
  msg << "Its thread (Linux thread id " << op.thread_id
      << ") still waits inside the op: for the other ranks (a collective with them), or in a CUDA call that waits "
         "for GPU work that waits for them. Another rank of the group most likely exited, stalled or never reached "
         "this op. ";
  ending(msg, act);
  return msg.str();
}

#if TE_EP_WITH_CUDA
std::string gpu_message(const Marker& m, Clock::time_point now, Action act, Clock::duration query_blocked) {
  std::ostringstream msg;
  start_message(msg, *m.what);
  msg << " has not finished on GPU " << m.device << " " << seconds(now - m.entered)
      << " s after it was entered on the host";
  limit(msg, m.timeout_ms);
  msg << "NCCL EP's high-throughput kernels wait for the other ranks without a time limit, so another rank of the "
         "group most likely exited, stalled or never reached this op (or this stream had that much other work "
         "queued ahead of it). ";
  if (query_blocked > Clock::duration::zero()) {
    msg << "The watchdog's query of the op's CUDA event has been blocked by the CUDA driver for "
        << seconds(query_blocked) << " s (another thread of this process waits inside a CUDA call behind that "
        << "work). ";
  }
  msg << "A kernel that does not end can't be stopped, and the CUDA context of this process can't be used again. ";
  ending(msg, act);
  return msg.str();
}
#endif

// Straight to the file descriptor: a stdio lock held by a blocked thread
// must not stop the message.
void write_line(const std::string& message) {
  const std::string line = message + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Called with the lock held. Ends the process under kExit: _exit runs no
// exit handler and no destructor, none of which may wait for the GPU now.
void fire(State& s, Action act, const std::string& message) {
  ++s.fired;
  write_line(message);
  if (act == Action::kExit) std::_Exit(kExitCode);
}

// The thread that decides: no CUDA call, so nothing the driver blocks can
// stop it.
void check(Action act) {
  pthread_setname_np(pthread_self(), "te_ep_wd_check");  // for thread dumps and debuggers
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  while (!s.stopping) {
    const auto now = Clock::now();
    auto next = now + kIdlePeriod;
    for (auto& [id, op] : s.ops) {
      (void)id;
      if (op.reported) continue;
      const auto due = deadline(op.entered, op.timeout_ms);
      if (now < due) {
        next = std::min(next, due);
        continue;
      }
      fire(s, act, host_message(op, now, act));
      op.reported = true;
    }
#if TE_EP_WITH_CUDA
    const auto blocked = s.querying ? now - s.query_started : Clock::duration::zero();
    const bool stuck = blocked >= kQueryStuck;
    for (auto& [stream, queue] : s.streams) {
      (void)stream;
      if (queue.empty() || queue.front().reported) continue;
      Marker& m = queue.front();  // later markers of a stream can't have finished before it
      const auto due = deadline(m.entered, m.timeout_ms);
      if (now < due) {
        next = std::min(next, due);
        continue;
      }
      // Past its deadline: fires once a query begun after the deadline found
      // it pending, or when the queries are blocked; else the poller's next
      // round (which wakes this thread) decides.
      if (m.seen_pending >= due || stuck) {
        fire(s, act, gpu_message(m, now, act, stuck ? blocked : Clock::duration::zero()));
        m.reported = true;
      } else if (s.querying) {
        next = std::min(next, s.query_started + kQueryStuck);
      }
    }
#endif
    s.checker_wakes_at = next;
    s.wake_checker.wait_until(lock, next);
  }
}

void ensure_checker(State& s) {
  if (s.checker_started) return;
  s.checker_started = true;
  std::thread(check, action()).detach();
}

#if TE_EP_WITH_CUDA
// One round of queries: the markers of each stream in order, up to the first
// that is pending, asked without holding the lock (a query the driver blocks
// blocks nobody else); finished ones retire. `lock` holds s.mu on entry and
// on return. The poller runs it every kPollPeriod; pending() runs it too, so
// that it counts only markers whose work has not finished.
void query_round(State& s, std::unique_lock<std::mutex>& lock) {
  struct Query {
    cudaStream_t stream;
    uint64_t id;
    cudaEvent_t event;
    bool asked;  // false: skipped, an earlier marker of its stream is pending
    cudaError_t status;
  };
  std::vector<Query> queries;
  for (const auto& [stream, queue] : s.streams) {
    for (const Marker& m : queue) {
      if (s.broken_devices.count(m.device) != 0) break;
      queries.push_back(Query{stream, m.id, m.event, false, cudaErrorNotReady});
    }
  }
  if (queries.empty()) return;
  const auto started = Clock::now();
  s.querying = true;
  s.query_started = started;
  lock.unlock();
  // A stream whose earlier marker is pending: its later ones are not asked. (A
  // flag of its own: the legacy default stream is the null handle, which must
  // not read as "no stream skipped".)
  bool skip = false;
  cudaStream_t skipping = nullptr;
  for (Query& q : queries) {
    if (skip && q.stream == skipping) continue;
    q.asked = true;
    q.status = cudaEventQuery(q.event);
    if (q.status != cudaSuccess) {
      (void)cudaGetLastError();
      skip = true;
      skipping = q.stream;
    }
  }
  lock.lock();
  s.querying = false;
  bool overdue = false;  // a marker past its deadline was found pending: the checker decides now
  for (const Query& q : queries) {
    auto it = s.streams.find(q.stream);
    if (!q.asked || it == s.streams.end() || it->second.empty() || it->second.front().id != q.id) continue;
    Marker& m = it->second.front();
    if (q.status == cudaErrorNotReady) {
      m.seen_pending = started;
      overdue = overdue || started >= deadline(m.entered, m.timeout_ms);
      continue;
    }
    if (q.status == cudaSuccess) {
      s.spare_events[m.device].push_back(m.event);
    } else {
      // A CUDA error (the context is broken, or the runtime is unloading):
      // it surfaces in the process's own next CUDA call; stop watching
      // this device and leave its events alone.
      s.broken_devices.insert(m.device);
    }
    it->second.pop_front();
  }
  // Nothing on a broken device will be answered: its markers go.
  for (auto& [stream, queue] : s.streams) {
    (void)stream;
    while (!queue.empty() && s.broken_devices.count(queue.front().device) != 0) queue.pop_front();
  }
  if (overdue) s.wake_checker.notify_all();
}

// The thread that asks the GPU.
void poll(int device) {
  // Relaxed: this thread's event queries must never count as unsafe calls
  // against a CUDA graph that another thread captures in global mode (torch's
  // default), which would invalidate that capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  // The device of the first watched op (a rank's own GPU): no context made on
  // another GPU for this thread.
  if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
  pthread_setname_np(pthread_self(), "te_ep_wd_poll");
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  while (!s.stopping) {
    s.wake_poller.wait_for(lock, kPollPeriod, [&] { return s.stopping; });
    if (s.stopping) break;
    query_round(s, lock);
  }
}
#endif

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

std::unique_ptr<Op> Op::enter(int64_t timeout_ms, std::shared_ptr<const std::string> what) {
  if (action() == Action::kOff || timeout_ms <= 0) return nullptr;
  const auto now = Clock::now();
  // Asked of the kernel once per thread: a system call on every op would cost
  // more than the rest of the watchdog's bookkeeping.
  thread_local const long thread_id = static_cast<long>(::syscall(SYS_gettid));
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stopping) return nullptr;
  const uint64_t id = s.next_id++;
  s.ops.emplace(id, HostOp{now, timeout_ms, what, thread_id});
  ensure_checker(s);
  // Ops almost always have the same limit, so a new one is rarely due first.
  if (deadline(now, timeout_ms) < s.checker_wakes_at) s.wake_checker.notify_all();
  return std::unique_ptr<Op>(new Op(id, now, timeout_ms, std::move(what)));
}

Op::Op(uint64_t id, Clock::time_point entered, int64_t timeout_ms, std::shared_ptr<const std::string> what)
    : id_(id), entered_(entered), timeout_ms_(timeout_ms), what_(std::move(what)) {}

Op::~Op() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ops.erase(id_);
}

#if TE_EP_WITH_CUDA
void Op::watch_stream(cudaStream_t stream, int device) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (capture != cudaStreamCaptureStatusNone) return;
  State& s = state();
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.stopping || s.broken_devices.count(device) != 0) return;
    auto& spare = s.spare_events[device];
    if (!spare.empty()) {
      event = spare.back();
      spare.pop_back();
    }
  }
  // The op itself was launched; its own errors surface where torch checks them.
  if (event == nullptr && cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  const bool recorded = cudaEventRecord(event, stream) == cudaSuccess;
  if (!recorded) (void)cudaGetLastError();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!recorded) {
    s.spare_events[device].push_back(event);
    return;
  }
  if (s.stopping) return;
  Marker m;
  m.id = s.next_id++;
  m.event = event;
  m.device = device;
  m.entered = entered_;
  m.timeout_ms = timeout_ms_;
  m.what = what_;
  s.streams[stream].push_back(std::move(m));
  if (!s.poller_started) {
    s.poller_started = true;
    std::thread(poll, device).detach();
  }
}
#endif

void stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stopping = true;
  s.ops.clear();
#if TE_EP_WITH_CUDA
  s.streams.clear();
  s.wake_poller.notify_all();
#endif
  s.wake_checker.notify_all();
}

int64_t pending() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
#if TE_EP_WITH_CUDA
  // Retire what has finished now, not at the poller's next round; relaxed, as the
  // poller, so that a CUDA graph this thread captures is not invalidated.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  query_round(s, lock);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
#endif
  int64_t total = static_cast<int64_t>(s.ops.size());
#if TE_EP_WITH_CUDA
  for (const auto& entry : s.streams) total += static_cast<int64_t>(entry.second.size());
#endif
  return total;
}

int64_t fired() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.fired;
}

}  // namespace watchdog
}  // namespace te_ep
