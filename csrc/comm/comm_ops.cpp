// Op adapters: the handle registry, argument checks against each handle's
// config, and the CPU/CUDA registrations that route to a handle's backend.
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <chrono>
#include <mutex>
#include <sstream>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "comm/core/routing.h"
#include "comm/backend.h"

namespace te_ep {
namespace {

struct HandleEntry {
  HandleConfig cfg;
  std::unique_ptr<Backend> backend;
  int64_t handle_mem_numel = 0;
  at::ScalarType handle_mem_dtype = at::kLong;
};

std::mutex g_mutex;
// Leaked on purpose, like the nccl_ep registry: handles still alive at exit
// must not be destroyed during static destruction, when the CUDA runtime may
// already be unloading. A leaked handle holds no process group (backends look
// theirs up by name), so none outlives dist.destroy_process_group().
std::unordered_map<int64_t, std::shared_ptr<HandleEntry>>& g_handles =
    *new std::unordered_map<int64_t, std::shared_ptr<HandleEntry>>();
// Configs of destroyed handles: a rank that destroyed its handle while the
// others did not can still take part in the error agreement of the op the
// others are running, so nobody waits forever.
std::unordered_map<int64_t, HandleConfig> g_destroyed;
int64_t g_next_id = 1;
// Handles created per process group so far (HandleConfig::seq).
std::unordered_map<std::string, int64_t> g_created;

std::string to_string(c10::string_view s) { return std::string(s.data(), s.size()); }

// A tensor's shape in a message, formatted only when the message is: argument
// checks run on every op, and nearly always pass.
struct ShapeOf {
  const at::Tensor& t;
};
std::ostream& operator<<(std::ostream& out, const ShapeOf& shape) { return out << shape.t.sizes(); }

// torch spells dtypes this way in Python; users read these messages there.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    default: return c10::toString(t);
  }
}

std::shared_ptr<HandleEntry> lookup(const char* op, int64_t handle_id) {
  HandleConfig destroyed;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_handles.find(handle_id);
    if (it != g_handles.end()) return it->second;
    auto dead = g_destroyed.find(handle_id);
    TORCH_CHECK(dead != g_destroyed.end(), "te_ep.", op, ": handle_id ", handle_id, " was never created");
    destroyed = dead->second;
  }
  std::ostringstream msg;
  msg << "te_ep." << op << ": handle_id " << handle_id
      << " was destroyed (EpHandle.destroy / EpGroup.shutdown); create a new handle";
  if (destroyed.backend == "reference") {
    make_reference_backend(destroyed)->agree_on_arguments(op, msg.str());
  }
  TORCH_CHECK(false, msg.str());
}

// The handle an op runs on: `handle_id`, or, with `handle_key` (a CPU int64
// tensor of one element, EpHandle.key), the id it holds. torch.compile passes
// the key with handle_id -1, so one compiled graph serves every layer's handle
// (an int argument would be a constant of the graph); any other handle_id must
// name the same handle as the key.
int64_t resolve_id(const char* op, int64_t handle_id, const c10::optional<at::Tensor>& handle_key) {
  if (!handle_key.has_value()) {
    TORCH_CHECK(handle_id != -1, "te_ep.", op, ": handle_id -1 needs handle_key (a CPU int64 tensor of one element "
                "holding the handle's id, EpHandle.key), got handle_key=None");
    return handle_id;
  }
  const at::Tensor& key = *handle_key;
  TORCH_CHECK(key.defined() && key.device().is_cpu() && key.scalar_type() == at::kLong && key.numel() == 1,
              "te_ep.", op, ": handle_key must be a CPU torch.int64 tensor of one element (EpHandle.key), got ",
              key.defined() ? c10::str(key.scalar_type(), " of shape ", key.sizes(), " on ", key.device())
                            : std::string("an undefined tensor"));
  const int64_t id = key.item<int64_t>();
  TORCH_CHECK(handle_id == -1 || handle_id == id, "te_ep.", op, ": handle_id (", handle_id,
              ") and handle_key (", id, ") name different handles; pass handle_id=-1 with handle_key");
  return id;
}

// The watchdog's limit for a handle without a timeout: torch's default
// process-group timeout (10 minutes).
constexpr int64_t kDefaultWatchdogMs = 10 * 60 * 1000;

}  // namespace

namespace {

std::shared_ptr<const std::string> watched_op_name(const HandleConfig& cfg, const char* op, int64_t handle_id) {
  std::string what = "te_ep.";
  what += op;
  if (handle_id >= 0) what += " on handle " + std::to_string(handle_id);
  what += " of group '" + cfg.group_name + "' (rank " + std::to_string(cfg.rank) + " of " +
          std::to_string(cfg.ep_size) + ")";
  return std::make_shared<const std::string>(std::move(what));
}

std::unique_ptr<watchdog::Op> enter_named(const HandleConfig& cfg, std::shared_ptr<const std::string> name) {
  return watchdog::Op::enter(cfg.timeout_ms > 0 ? cfg.timeout_ms : kDefaultWatchdogMs, std::move(name));
}

}  // namespace

std::unique_ptr<watchdog::Op> enter_watched_op(const HandleConfig& cfg, const char* op, int64_t handle_id) {
  if (watchdog::action() == watchdog::Action::kOff) return nullptr;
  return enter_named(cfg, watched_op_name(cfg, op, handle_id));
}

std::unique_ptr<watchdog::Op> WatchedOps::enter(const HandleConfig& cfg, const char* op, int64_t handle_id) {
  if (watchdog::action() == watchdog::Action::kOff) return nullptr;
  std::shared_ptr<const std::string> text;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Name& name : names_) {
      if (name.handle_id == handle_id && name.op == op) {
        text = name.text;
        break;
      }
    }
    if (text == nullptr) {
      text = watched_op_name(cfg, op, handle_id);
      names_.push_back(Name{op, handle_id, text});
    }
  }
  return enter_named(cfg, std::move(text));
}

namespace {

// The first line of a message (transport errors carry long backtraces).
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Runs `op` on handle `handle_id`: the ranks' agreement on `error` (the first
// argument error found here, or empty) and on the op and handle each runs
// (Backend::agree_on_arguments), then `real`, or `substitute` where the check
// mode has this rank run the op on zero rows of the prepared shapes so that
// the others' collectives complete (it returns zeros in the shapes the op's
// fake kernel gives for the caller's arguments). A te_ep error gets the handle
// and its group appended; a failure of a collective itself (a rank exited, or
// did not reach the op within the process group's timeout) becomes an error
// that names the op and the handle and says what state the process is in
// (docs/ops.md, "Faults and bad input"). The backend's watchdog
// (Backend::watch) watches the op from here on: its host part until it
// returns or throws, then the GPU work it launched. Anything else (a CUDA
// error, running out of memory) propagates unchanged, with its type.
template <typename Real, typename Substitute>
auto run_op(const HandleEntry& h, int64_t handle_id, const char* op, const std::string& error, Real&& real,
            Substitute&& substitute) -> decltype(real()) {
  const std::unique_ptr<watchdog::Op> watched = h.backend->watch(op, handle_id);
  std::string transport;
  try {
    auto result = h.backend->agree_on_arguments(op, error) ? substitute() : real();
    if (watched) h.backend->watch_launched(*watched);
    return result;
  } catch (const c10::DistError& e) {
    transport = first_line(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.rfind("te_ep.", 0) != 0) throw;
    TORCH_CHECK(false, msg, "\n(handle ", handle_id, " of group '", h.cfg.group_name, "')");
  } catch (const std::runtime_error& e) {  // gloo's transport errors are not c10 errors
    transport = first_line(e.what());
  }
  TORCH_CHECK(false, "te_ep.", op, " on handle ", handle_id, " of group '", h.cfg.group_name,
              "': a collective with the other ranks failed (", transport,
              "): a rank exited or did not reach this op within the process group's timeout. The process group "
              "can no longer be used: exit and let torchrun restart the job, or destroy it and build a new process "
              "group and EpGroup");
}

// Collects the first argument error of an op as a message instead of
// throwing, so the ranks can agree on it before any rank gives up.
class ArgCheck {
 public:
  ArgCheck(const char* op, const HandleConfig& cfg) : op_(op), cfg_(cfg) {}

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  template <typename... Args>
  ArgCheck& require(bool cond, const Args&... parts) {
    if (ok() && !cond) {
      std::ostringstream msg;
      msg << "te_ep." << op_ << ": ";
      (msg << ... << parts);
      error_ = msg.str();
    }
    return *this;
  }

  // Device, contiguity and rank of a tensor argument, in the order a user
  // would want them reported.
  ArgCheck& tensor(const at::Tensor& t, const char* name, int64_t dim, const char* dims) {
    require(t.defined(), name, " must be a tensor, got None");
    if (!ok()) return *this;
    require(
        t.device() == cfg_.device, name, " must be on ", cfg_.device, " (the handle's device), got ", t.device());
    require(t.dim() == dim, name, " must be ", dim, "-D ", dims, ", got shape ", ShapeOf{t});
    require(t.is_contiguous(), name, " must be contiguous (got strides ", t.strides(), ")");
    return *this;
  }

  ArgCheck& dtype(const at::Tensor& t, const char* name, at::ScalarType expected, const char* why) {
    return require(
        t.scalar_type() == expected, name, " must be ", dtype_name(expected), why, ", got ", dtype_name(t.scalar_type()));
  }

  ArgCheck& size(const at::Tensor& t, const char* name, int64_t d, int64_t expected, const char* what) {
    if (ok() && t.dim() > d) {
      require(t.size(d) == expected, name, ".size(", d, ") must be ", expected, " (", what, "), got ", t.size(d));
    }
    return *this;
  }

 private:
  const char* op_;
  const HandleConfig& cfg_;
  std::string error_;
};

void check_common(ArgCheck& check, HandleEntry& h, const at::Tensor& handle_mem, c10::string_view group_name) {
  const HandleConfig& cfg = h.cfg;
  const std::string_view name(group_name.data(), group_name.size());
  check.require(name == cfg.group_name, "group_name must be '", cfg.group_name, "' (the handle's group), got '", name,
                "'");
  check.tensor(handle_mem, "handle_mem", 1, "[n]");
  check.require(
      handle_mem.scalar_type() == h.handle_mem_dtype && handle_mem.numel() == h.handle_mem_numel,
      "handle_mem must be the buffer returned by create_handle for this handle (", h.handle_mem_numel, " x ",
      dtype_name(h.handle_mem_dtype), "), got ", handle_mem.numel(), " x ", dtype_name(handle_mem.scalar_type()));
}

// What every communication op starts with: the handle it runs on (resolve_id,
// lookup), its config, and the argument check with the checks every op shares.
struct OpStart {
  int64_t id;
  std::shared_ptr<HandleEntry> h;
  const HandleConfig& cfg;
  ArgCheck check;
};

OpStart start_op(const char* op, int64_t handle_id, const c10::optional<at::Tensor>& handle_key,
                 const at::Tensor& handle_mem, c10::string_view group_name) {
  const int64_t id = resolve_id(op, handle_id, handle_key);
  auto h = lookup(op, id);
  OpStart start{id, h, h->cfg, ArgCheck(op, h->cfg)};
  check_common(start.check, *h, handle_mem, group_name);
  return start;
}

constexpr const char* kLastPrepare = "tokens of the last prepare";

// t.size(0) against a routing of `num_tokens` tokens (-1: the handle has none
// yet; `what` says where that number comes from).
void check_routed_rows(ArgCheck& check, const at::Tensor& t, const char* name, int64_t num_tokens, const char* what) {
  check.require(num_tokens >= 0, "the handle has no routing: call prepare (or ep_dispatch) first");
  check.size(t, name, 0, num_tokens, what);
}

// Rows in token order: [num_tokens, hidden] of the handle's dtype (num_tokens
// as in check_routed_rows).
void check_token_rows(ArgCheck& check, const HandleConfig& cfg, const at::Tensor& t, const char* name,
                      int64_t num_tokens, const char* what) {
  check.tensor(t, name, 2, "[num_tokens, hidden]");
  check.dtype(t, name, cfg.dtype, " (the handle's dtype)");
  check.size(t, name, 1, cfg.hidden, "the handle's hidden");
  check_routed_rows(check, t, name, num_tokens, what);
}

// Rows of the receive buffer: [capacity, hidden].
void check_recv_rows(ArgCheck& check, const HandleConfig& cfg, const at::Tensor& t, const char* name) {
  check.tensor(t, name, 2, "[capacity, hidden]");
  check.dtype(t, name, cfg.dtype, " (the handle's dtype)");
  check.size(t, name, 0, cfg.capacity, "the handle's capacity");
  check.size(t, name, 1, cfg.hidden, "the handle's hidden");
}

// The num_tokens argument of the ops that return to token order.
void check_num_tokens(ArgCheck& check, HandleEntry& h, const at::Tensor& handle_mem, int64_t num_tokens) {
  const int64_t prepared = h.backend->prepared_num_tokens(handle_mem);
  check.require(prepared >= 0, "the handle has no routing: call prepare (or ep_dispatch) first");
  check.require(
      !check.ok() || num_tokens == prepared, "num_tokens must be ", prepared, " (tokens of the last prepare), got ",
      num_tokens);
}

// Rows of the last prepare on this rank (0 after a failed prepare).
int64_t prepared_rows(HandleEntry& h, const at::Tensor& handle_mem) {
  return std::max<int64_t>(h.backend->prepared_num_tokens(handle_mem), 0);
}

at::Tensor zero_rows(const HandleConfig& cfg, int64_t rows, int64_t cols, at::ScalarType dtype) {
  return at::zeros({std::max<int64_t>(rows, 0), std::max<int64_t>(cols, 0)},
                   at::TensorOptions().dtype(dtype).device(cfg.device));
}

// [rows, t.size(1)] of t's dtype when t is 2-D (the fake kernel's shape), else
// [rows, cols] of `dtype`.
at::Tensor zero_rows_like(const HandleConfig& cfg, const at::Tensor& t, int64_t rows, int64_t cols,
                          at::ScalarType dtype) {
  if (t.defined() && t.dim() == 2) return zero_rows(cfg, rows, t.size(1), t.scalar_type());
  return zero_rows(cfg, rows, cols, dtype);
}

at::Tensor zero_rows_like(const HandleConfig& cfg, const at::Tensor& t, int64_t rows) {
  return zero_rows_like(cfg, t, rows, cfg.hidden, cfg.dtype);
}

at::Tensor zero_weights(const HandleConfig& cfg, int64_t rows) {
  return at::zeros({std::max<int64_t>(rows, 0)}, at::TensorOptions().dtype(at::kFloat).device(cfg.device));
}

// A handle's configuration from create_handle's arguments, and the first rule
// they break ("" if none). The one owner of these rules: create_handle throws
// the error, and EpGroup.create_handle asks for it (_handle_config_error)
// before its ranks agree, so every rank raises it as a ValueError.
std::pair<HandleConfig, std::string> handle_config(
    c10::string_view group_name, c10::string_view backend, int64_t num_experts, int64_t max_tokens_per_rank,
    int64_t top_k, int64_t hidden, int64_t capacity, int64_t alignment, at::ScalarType dtype, at::Device device,
    c10::string_view nccl_ep_mode, std::optional<at::ScalarType> dispatch_dtype, int64_t timeout_ms,
    c10::string_view checks) {
  HandleConfig cfg;
  std::ostringstream error;
  auto rule = [&](bool holds, const auto&... parts) {
    if (!holds && error.tellp() == 0) (error << "te_ep.create_handle: " << ... << parts);
  };
  cfg.group_name = to_string(group_name);
  cfg.backend = to_string(backend);
  cfg.nccl_ep_mode = to_string(nccl_ep_mode);
  const std::string checks_arg = to_string(checks);
  rule(cfg.backend == "reference" || cfg.backend == "nccl_ep", "backend must be 'reference' or 'nccl_ep', got '",
       cfg.backend, "'");
  rule(cfg.nccl_ep_mode == "auto" || cfg.nccl_ep_mode == "zero_copy" || cfg.nccl_ep_mode == "staged",
       "nccl_ep_mode must be 'auto', 'zero_copy' or 'staged', got '", cfg.nccl_ep_mode, "'");
  const std::optional<Checks> parsed = parse_checks(checks_arg);
  rule(parsed.has_value(), "checks must be 'local', 'device' or 'synchronous', got '", checks_arg, "'");
  cfg.checks = parsed.value_or(Checks::kLocal);
  auto pg = c10d::resolve_process_group(cfg.group_name);
  cfg.ep_size = pg->getSize();
  cfg.rank = pg->getRank();
  rule(num_experts > 0, "num_experts must be positive, got ", num_experts);
  rule(num_experts % cfg.ep_size == 0, "num_experts (", num_experts, ") must be divisible by the EP size (",
       cfg.ep_size, ")");
  rule(max_tokens_per_rank > 0, "max_tokens_per_rank must be positive, got ", max_tokens_per_rank);
  rule(top_k > 0, "top_k must be positive, got ", top_k);
  rule(top_k <= num_experts, "top_k (", top_k, ") must not exceed num_experts (", num_experts, ")");
  rule(hidden > 0, "hidden must be positive, got ", hidden);
  rule(common::is_power_of_two(alignment), "alignment must be a power of two, got ", alignment);
  rule(capacity > 0, "capacity must be positive, got ", capacity);
  rule(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
       "dtype must be torch.bfloat16, torch.float16 or torch.float32, got ", dtype_name(dtype));
  rule(device.is_cpu() || device.is_cuda(), "device must be cpu or cuda, got ", device);
  rule(!device.is_cuda() || device.has_index(), "device must name a CUDA device index (e.g. cuda:0), got ", device);
  if (dispatch_dtype.has_value()) {
    rule(*dispatch_dtype == at::kFloat8_e4m3fn, "dispatch_dtype must be None or torch.float8_e4m3fn, got ",
         dtype_name(*dispatch_dtype));
    rule(hidden % kFp8Block == 0, "FP8 dispatch scales blocks of ", kFp8Block,
         " values, so hidden must be a multiple of ", kFp8Block, ", got hidden=", hidden);
  }
  rule(timeout_ms >= 0, "timeout_ms must be >= 0 (0: NCCL EP's default), got ", timeout_ms);
  cfg.dispatch_dtype = dispatch_dtype;
  cfg.timeout_ms = timeout_ms;
  cfg.num_experts = num_experts;
  cfg.max_tokens_per_rank = max_tokens_per_rank;
  cfg.top_k = top_k;
  cfg.hidden = hidden;
  cfg.capacity = capacity;
  cfg.alignment = alignment;
  cfg.dtype = dtype;
  cfg.device = device;
  return {cfg, error.str()};
}

std::string handle_config_error(
    c10::string_view group_name, c10::string_view backend, int64_t num_experts, int64_t max_tokens_per_rank,
    int64_t top_k, int64_t hidden, int64_t capacity, int64_t alignment, at::ScalarType dtype, at::Device device,
    c10::string_view nccl_ep_mode, std::optional<at::ScalarType> dispatch_dtype, int64_t timeout_ms,
    c10::string_view checks) {
  return handle_config(group_name, backend, num_experts, max_tokens_per_rank, top_k, hidden, capacity, alignment,
                       dtype, device, nccl_ep_mode, dispatch_dtype, timeout_ms, checks)
      .second;
}

std::tuple<int64_t, at::Tensor> create_handle(
    c10::string_view group_name, c10::string_view backend, int64_t num_experts, int64_t max_tokens_per_rank,
    int64_t top_k, int64_t hidden, int64_t capacity, int64_t alignment, at::ScalarType dtype, at::Device device,
    c10::string_view nccl_ep_mode, std::optional<at::ScalarType> dispatch_dtype, int64_t timeout_ms,
    c10::string_view checks) {
  auto [cfg, error] = handle_config(group_name, backend, num_experts, max_tokens_per_rank, top_k, hidden, capacity,
                                    alignment, dtype, device, nccl_ep_mode, dispatch_dtype, timeout_ms, checks);
  TORCH_CHECK(error.empty(), error);

  {
    std::lock_guard<std::mutex> lock(g_mutex);
    cfg.seq = ++g_created[cfg.group_name];
  }
  auto entry = std::make_shared<HandleEntry>();
  entry->cfg = cfg;
  entry->backend = cfg.backend == "reference" ? make_reference_backend(cfg) : make_nccl_ep_backend(cfg);
  at::Tensor mem = entry->backend->allocate_handle_mem();
  entry->handle_mem_numel = mem.numel();
  entry->handle_mem_dtype = mem.scalar_type();

  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t id = g_next_id++;
  g_handles.emplace(id, std::move(entry));
  return {id, mem};
}

void destroy_handle(int64_t handle_id) {
  std::shared_ptr<HandleEntry> entry;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_handles.find(handle_id);
    TORCH_CHECK(
        it != g_handles.end(), "te_ep.destroy_handle: handle_id ", handle_id,
        g_destroyed.count(handle_id) ? " was already destroyed" : " was never created");
    entry = std::move(it->second);
    g_handles.erase(it);
    g_destroyed.emplace(handle_id, entry->cfg);
  }
}

std::tuple<std::string, std::string, int64_t, int64_t> handle_info(int64_t handle_id) {
  auto h = lookup("handle_info", handle_id);
  return {h->backend->mode(), h->backend->mode_reason(), h->backend->window_bytes(),
          h->handle_mem_numel * static_cast<int64_t>(c10::elementSize(h->handle_mem_dtype))};
}

// Holds the host for `seconds` inside a watched op `op` of handle `handle_id`
// (any backend): a stalled op as the watchdog sees it, for the CPU test of the
// watchdog (tests/test_watchdog_host.py), without a GPU or a lost peer.
void watchdog_test_hold(int64_t handle_id, c10::string_view op, double seconds) {
  auto h = lookup("_watchdog_test_hold", handle_id);
  const std::string name = to_string(op);
  const std::unique_ptr<watchdog::Op> watched = enter_watched_op(h->cfg, name.c_str(), handle_id);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

std::string check_mode(int64_t handle_id) { return checks_name(lookup("check_mode", handle_id)->backend->checks()); }

void check_handle(int64_t handle_id) {
  auto h = lookup("check_handle", handle_id);
  const std::unique_ptr<watchdog::Op> watched = h->backend->watch("check_handle", handle_id);
  try {
    h->backend->raise_pending_errors();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(), "\n(handle ", handle_id, " of group '", h->cfg.group_name, "')");
  }
}

c10::optional<at::Tensor> combine_buffer(int64_t handle_id) {
  at::Tensor buffer = lookup("combine_buffer", handle_id)->backend->combine_buffer();
  if (!buffer.defined()) return c10::nullopt;
  return buffer;
}

int64_t worst_case_capacity_op(
    int64_t ep_size, int64_t max_tokens_per_rank, int64_t top_k, int64_t num_local_experts, int64_t alignment) {
  TORCH_CHECK(ep_size > 0 && max_tokens_per_rank > 0 && top_k > 0 && num_local_experts > 0,
              "te_ep.worst_case_capacity: sizes must be positive, got ep_size=", ep_size, ", max_tokens_per_rank=",
              max_tokens_per_rank, ", top_k=", top_k, ", num_local_experts=", num_local_experts);
  TORCH_CHECK(common::is_power_of_two(alignment), "te_ep.worst_case_capacity: alignment must be a power of two, got ",
              alignment);
  return common::worst_case_capacity(ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment);
}

std::vector<int64_t> live_handles() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<int64_t> ids;
  for (const auto& kv : g_handles) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// prepare's argument checks (after the ones every op shares) and the
// backend's own check of the routing values: the first error, or "".
std::string prepare_error(ArgCheck& check, HandleEntry& h, const at::Tensor& topk_idx, int64_t num_local_experts) {
  const HandleConfig& cfg = h.cfg;
  check.require(
      num_local_experts == cfg.num_local_experts(), "num_local_experts must be ", cfg.num_local_experts(),
      " (num_experts / EP size), got ", num_local_experts);
  check.tensor(topk_idx, "topk_idx", 2, "[num_tokens, top_k]");
  check.require(
      topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
      "topk_idx must be torch.int64 or torch.int32, got ", dtype_name(topk_idx.scalar_type()));
  check.size(topk_idx, "topk_idx", 1, cfg.top_k, "the handle's top_k");
  check.require(
      !check.ok() || topk_idx.size(0) <= cfg.max_tokens_per_rank, "topk_idx.size(0) (num_tokens) must be at most ",
      cfg.max_tokens_per_rank, " (max_tokens_per_rank of the group), got ", check.ok() ? topk_idx.size(0) : 0);
  if (!check.ok()) return check.error();
  const std::string error = h.backend->validate_routing(topk_idx);
  return error.empty() ? error : "te_ep.prepare: " + error;
}

// dispatch's checks of tokens and topk_weights against the routing of
// `num_tokens` tokens (as in check_routed_rows).
void check_dispatch_inputs(ArgCheck& check, const HandleConfig& cfg, const at::Tensor& tokens,
                           const at::Tensor& topk_weights, int64_t capacity, int64_t num_tokens, const char* what) {
  check.require(capacity == cfg.capacity, "capacity must be ", cfg.capacity, " (the handle's), got ", capacity);
  check_token_rows(check, cfg, tokens, "tokens", num_tokens, what);
  check.tensor(topk_weights, "topk_weights", 2, "[num_tokens, top_k]");
  check.dtype(topk_weights, "topk_weights", at::kFloat, "");
  check.size(topk_weights, "topk_weights", 0, check.ok() ? tokens.size(0) : 0, "num_tokens");
  check.size(topk_weights, "topk_weights", 1, cfg.top_k, "the handle's top_k");
}

// dispatch_fp8's checks of values, scales and topk_weights against the
// routing of `num_tokens` tokens (as in check_routed_rows).
void check_fp8_inputs(ArgCheck& check, const HandleConfig& cfg, const at::Tensor& values, const at::Tensor& scales,
                      const at::Tensor& topk_weights, int64_t capacity, int64_t num_tokens, const char* what) {
  check.require(cfg.dispatch_dtype == at::kFloat8_e4m3fn, "the handle was created without FP8 dispatch; create it "
                "with dispatch_dtype=torch.float8_e4m3fn");
  check.require(capacity == cfg.capacity, "capacity must be ", cfg.capacity, " (the handle's), got ", capacity);
  check.tensor(values, "values", 2, "[num_tokens, hidden]");
  check.dtype(values, "values", at::kFloat8_e4m3fn, " (FP8 dispatch)");
  check.size(values, "values", 1, cfg.hidden, "the handle's hidden");
  check_routed_rows(check, values, "values", num_tokens, what);
  const int64_t rows = check.ok() ? values.size(0) : 0;
  check.tensor(scales, "scales", 2, "[num_tokens, hidden / 128]");
  check.dtype(scales, "scales", at::kFloat, "");
  check.size(scales, "scales", 0, rows, "num_tokens");
  check.size(scales, "scales", 1, cfg.hidden / kFp8Block, "one scale per 128 values");
  check.tensor(topk_weights, "topk_weights", 2, "[num_tokens, top_k]");
  check.dtype(topk_weights, "topk_weights", at::kFloat, "");
  check.size(topk_weights, "topk_weights", 0, rows, "num_tokens");
  check.size(topk_weights, "topk_weights", 1, cfg.top_k, "the handle's top_k");
}

std::tuple<at::Tensor, at::Tensor> prepare(
    const at::Tensor& topk_idx, at::Tensor& handle_mem, c10::string_view group_name, int64_t handle_id,
    int64_t num_local_experts,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("prepare", handle_id, handle_key, handle_mem, group_name);
  const std::string error = prepare_error(check, *h, topk_idx, num_local_experts);
  return run_op(
      *h, id, "prepare", error, [&] { return h->backend->prepare(topk_idx, handle_mem); },
      [&] {
        // This rank's step moves nothing and fails on every rank (the device checks).
        const at::Tensor no_tokens = at::empty({0, cfg.top_k}, at::TensorOptions().dtype(at::kLong).device(cfg.device));
        return h->backend->prepare(no_tokens, handle_mem);
      });
}

std::tuple<at::Tensor, at::Tensor> dispatch(
    const at::Tensor& tokens, const at::Tensor& topk_weights, const at::Tensor& handle_mem,
    c10::string_view group_name, int64_t handle_id, int64_t capacity,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("dispatch", handle_id, handle_key, handle_mem, group_name);
  check_dispatch_inputs(check, cfg, tokens, topk_weights, capacity, h->backend->prepared_num_tokens(handle_mem),
                        kLastPrepare);
  return run_op(
      *h, id, "dispatch", check.error(),
      [&] { return h->backend->dispatch(tokens, topk_weights, handle_mem); },
      [&] {
        const int64_t rows = prepared_rows(*h, handle_mem);
        h->backend->dispatch(zero_rows(cfg, rows, cfg.hidden, cfg.dtype), zero_rows(cfg, rows, cfg.top_k, at::kFloat),
                             handle_mem);
        return std::make_tuple(zero_rows_like(cfg, tokens, capacity), zero_weights(cfg, capacity));
      });
}

// ep_dispatch's op. Where the ranks agree on every op's arguments (the device
// and synchronous check modes, the reference backend), it is prepare then
// dispatch, each agreed on as it would be alone, so a rank calling the two ops
// and one calling this agree step by step. In the local check mode nothing is
// agreed: both halves' arguments are checked first (each error worded as its
// op words it), then the backend's prepare_dispatch runs as one watched op.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch(
    const at::Tensor& tokens, const at::Tensor& topk_idx, const at::Tensor& topk_weights, at::Tensor& handle_mem,
    c10::string_view group_name, int64_t handle_id, int64_t num_local_experts, int64_t capacity,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("prepare", handle_id, handle_key, handle_mem, group_name);
  if (h->backend->checks() != Checks::kLocal) {
    auto [expert_counts, total] = prepare(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key);
    auto [recv_tokens, recv_weights] = dispatch(tokens, topk_weights, handle_mem, group_name, handle_id, capacity,
                                                handle_key);
    return {recv_tokens, recv_weights, expert_counts, total};
  }
  std::string error = prepare_error(check, *h, topk_idx, num_local_experts);
  if (error.empty()) {
    ArgCheck dispatch_check("dispatch", cfg);
    check_dispatch_inputs(dispatch_check, cfg, tokens, topk_weights, capacity, topk_idx.size(0),
                          "topk_idx.size(0), the tokens routed");
    error = dispatch_check.error();
  }
  using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
  return run_op(
      *h, id, "prepare_dispatch", error,
      [&] { return h->backend->prepare_dispatch(topk_idx, tokens, topk_weights, handle_mem); },
      []() -> Outputs { TORCH_INTERNAL_ASSERT(false, "te_ep: the local check mode runs no substitutes"); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(
    const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights, const at::Tensor& handle_mem,
    c10::string_view group_name, int64_t handle_id, int64_t capacity,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("dispatch_fp8", handle_id, handle_key, handle_mem, group_name);
  check_fp8_inputs(check, cfg, values, scales, topk_weights, capacity, h->backend->prepared_num_tokens(handle_mem),
                   kLastPrepare);
  return run_op(
      *h, id, "dispatch_fp8", check.error(),
      [&] { return h->backend->dispatch_fp8(values, scales, topk_weights, handle_mem); },
      [&] {
        // A handle without FP8 dispatch (the same on every rank: create_handle
        // agrees on it) moves the substitute rows in its own dtype.
        const int64_t rows = prepared_rows(*h, handle_mem);
        if (cfg.dispatch_dtype == at::kFloat8_e4m3fn) {
          h->backend->dispatch_fp8(zero_rows(cfg, rows, cfg.hidden, at::kFloat8_e4m3fn),
                                   zero_rows(cfg, rows, cfg.hidden / kFp8Block, at::kFloat),
                                   zero_rows(cfg, rows, cfg.top_k, at::kFloat), handle_mem);
        } else {
          h->backend->dispatch(zero_rows(cfg, rows, cfg.hidden, cfg.dtype), zero_rows(cfg, rows, cfg.top_k, at::kFloat),
                               handle_mem);
        }
        return std::make_tuple(zero_rows_like(cfg, values, capacity, cfg.hidden, at::kFloat8_e4m3fn),
                               zero_rows_like(cfg, scales, capacity, cfg.hidden / kFp8Block, at::kFloat),
                               zero_weights(cfg, capacity));
      });
}

// ep_dispatch_fp8's op, as prepare_dispatch is ep_dispatch's: prepare then
// dispatch_fp8, each agreed on as alone, where the ranks agree on every op's
// arguments; in the local check mode both halves' checks, then the
// backend's prepare_dispatch_fp8 as one watched op.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch_fp8(
    const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
    at::Tensor& handle_mem, c10::string_view group_name, int64_t handle_id, int64_t num_local_experts,
    int64_t capacity, const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("prepare", handle_id, handle_key, handle_mem, group_name);
  if (h->backend->checks() != Checks::kLocal) {
    auto [expert_counts, total] = prepare(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key);
    auto [recv_values, recv_scales, recv_weights] =
        dispatch_fp8(values, scales, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key);
    return {recv_values, recv_scales, recv_weights, expert_counts, total};
  }
  std::string error = prepare_error(check, *h, topk_idx, num_local_experts);
  if (error.empty()) {
    ArgCheck dispatch_check("dispatch_fp8", cfg);
    check_fp8_inputs(dispatch_check, cfg, values, scales, topk_weights, capacity, topk_idx.size(0),
                     "topk_idx.size(0), the tokens routed");
    error = dispatch_check.error();
  }
  using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
  return run_op(
      *h, id, "prepare_dispatch_fp8", error,
      [&] { return h->backend->prepare_dispatch_fp8(topk_idx, values, scales, topk_weights, handle_mem); },
      []() -> Outputs { TORCH_INTERNAL_ASSERT(false, "te_ep: the local check mode runs no substitutes"); });
}

at::Tensor combine(
    const at::Tensor& expert_out, const at::Tensor& handle_mem, c10::string_view group_name, int64_t handle_id,
    int64_t num_tokens,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("combine", handle_id, handle_key, handle_mem, group_name);
  check_recv_rows(check, cfg, expert_out, "expert_out");
  check_num_tokens(check, *h, handle_mem, num_tokens);
  return run_op(
      *h, id, "combine", check.error(),
      [&] { return h->backend->combine(expert_out, handle_mem, num_tokens); },
      [&] {
        h->backend->combine(zero_rows(cfg, cfg.capacity, cfg.hidden, cfg.dtype), handle_mem,
                            prepared_rows(*h, handle_mem));
        return zero_rows_like(cfg, expert_out, num_tokens);
      });
}

std::tuple<at::Tensor, at::Tensor> dispatch_bwd(
    const at::Tensor& grad_recv_tokens, const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
    c10::string_view group_name, int64_t handle_id, int64_t num_tokens, int64_t top_k,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("dispatch_bwd", handle_id, handle_key, handle_mem, group_name);
  check.require(top_k == cfg.top_k, "top_k must be ", cfg.top_k, " (the handle's), got ", top_k);
  check_recv_rows(check, cfg, grad_recv_tokens, "grad_recv_tokens");
  check.tensor(grad_recv_weights, "grad_recv_weights", 1, "[capacity]");
  check.dtype(grad_recv_weights, "grad_recv_weights", at::kFloat, "");
  check.size(grad_recv_weights, "grad_recv_weights", 0, cfg.capacity, "the handle's capacity");
  check_num_tokens(check, *h, handle_mem, num_tokens);
  return run_op(
      *h, id, "dispatch_bwd", check.error(),
      [&] { return h->backend->dispatch_bwd(grad_recv_tokens, grad_recv_weights, handle_mem, num_tokens); },
      [&] {
        h->backend->dispatch_bwd(zero_rows(cfg, cfg.capacity, cfg.hidden, cfg.dtype), zero_weights(cfg, cfg.capacity),
                                 handle_mem, prepared_rows(*h, handle_mem));
        const at::ScalarType weights_dtype =
            grad_recv_weights.defined() ? grad_recv_weights.scalar_type() : at::kFloat;
        return std::make_tuple(zero_rows_like(cfg, grad_recv_tokens, num_tokens),
                               zero_rows(cfg, num_tokens, top_k, weights_dtype));
      });
}

at::Tensor combine_bwd(
    const at::Tensor& grad_out, const at::Tensor& handle_mem, c10::string_view group_name, int64_t handle_id,
    int64_t capacity,
    const c10::optional<at::Tensor>& handle_key) {
  auto [id, h, cfg, check] = start_op("combine_bwd", handle_id, handle_key, handle_mem, group_name);
  check.require(capacity == cfg.capacity, "capacity must be ", cfg.capacity, " (the handle's), got ", capacity);
  check_token_rows(check, cfg, grad_out, "grad_out", h->backend->prepared_num_tokens(handle_mem), kLastPrepare);
  return run_op(
      *h, id, "combine_bwd", check.error(), [&] { return h->backend->combine_bwd(grad_out, handle_mem); },
      [&] {
        h->backend->combine_bwd(zero_rows(cfg, prepared_rows(*h, handle_mem), cfg.hidden, cfg.dtype), handle_mem);
        return zero_rows_like(cfg, grad_out, capacity);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(te_ep, CompositeExplicitAutograd, m) {
  m.impl("create_handle", &create_handle);
  m.impl("_handle_config_error", &handle_config_error);
  m.impl("destroy_handle", &destroy_handle);
  m.impl("live_handles", &live_handles);
  m.impl("handle_info", &handle_info);
  m.impl("combine_buffer", &combine_buffer);
  m.impl("check_mode", &check_mode);
  m.impl("check_handle", &check_handle);
  m.impl("_watchdog_test_hold", &watchdog_test_hold);
  m.impl("worst_case_capacity", &worst_case_capacity_op);
}

// The adapters are device-agnostic: the handle's backend decides what runs.
static void register_comm_ops(torch::Library& m) {
  m.impl("prepare", &prepare);
  m.impl("dispatch", &dispatch);
  m.impl("prepare_dispatch", &prepare_dispatch);
  m.impl("dispatch_fp8", &dispatch_fp8);
  m.impl("prepare_dispatch_fp8", &prepare_dispatch_fp8);
  m.impl("combine", &combine);
  m.impl("dispatch_bwd", &dispatch_bwd);
  m.impl("combine_bwd", &combine_bwd);
}

TORCH_LIBRARY_IMPL(te_ep, CPU, m) { register_comm_ops(m); }

TORCH_LIBRARY_IMPL(te_ep, CUDA, m) { register_comm_ops(m); }

}  // namespace te_ep
