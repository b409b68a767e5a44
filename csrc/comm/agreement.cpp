// Agreement on the host over a handle's process group: the reference
// backend's per-op agreement, the nccl_ep synchronous check mode's, and the
// exchanges of nccl_ep's handle creation. One exchange serves them all.
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <sstream>

#include "comm/backend.h"

namespace te_ep {

namespace {

// Longest per-rank message carried by an exchange.
constexpr int64_t kMaxMessage = 1024;

// What a rank runs, identical on every rank that runs the same op on the same
// handle (a handle's id is per process; its number in the group is not).
std::string identity(const HandleConfig& cfg, const std::string& op) {
  std::ostringstream out;
  out << "te_ep." << op << " on the group's handle #" << cfg.seq << " (top_k=" << cfg.top_k
      << ", hidden=" << cfg.hidden << ", " << cfg.dtype << ", capacity=" << cfg.capacity << ")";
  return out.str();
}

// Separates a rank's identity from its error inside one message.
constexpr char kSeparator = '\x1f';

}  // namespace

const char* checks_name(Checks checks) {
  switch (checks) {
    case Checks::kLocal: return "local";
    case Checks::kDevice: return "device";
    case Checks::kSynchronous: return "synchronous";
  }
  return "";
}

std::optional<Checks> parse_checks(const std::string& name) {
  for (Checks checks : {Checks::kLocal, Checks::kDevice, Checks::kSynchronous}) {
    if (name == checks_name(checks)) return checks;
  }
  return std::nullopt;
}

std::vector<std::string> gather_messages(const HandleConfig& cfg, const std::string& local) {
  auto pg = c10d::resolve_process_group(cfg.group_name);
  at::Device where(at::kCPU);
  for (const auto& type : pg->getDeviceTypes()) {
    if (type.is_cuda() && cfg.device.is_cuda()) where = cfg.device;
  }
  const int64_t world = pg->getSize();
  at::Tensor rows = at::zeros({world, kMaxMessage}, at::kInt);
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(local.size()), kMaxMessage - 1);
  int32_t* mine = rows.data_ptr<int32_t>() + pg->getRank() * kMaxMessage;
  for (int64_t i = 0; i < n; ++i) mine[i] = static_cast<unsigned char>(local[i]);
  std::vector<at::Tensor> bufs{rows.to(where)};
  pg->allreduce(bufs)->wait();
  rows = bufs[0].cpu();
  std::vector<std::string> messages;
  const int32_t* all = rows.data_ptr<int32_t>();
  for (int64_t r = 0; r < world; ++r) {
    std::string msg;
    for (int64_t i = 0; i < kMaxMessage && all[r * kMaxMessage + i] != 0; ++i) {
      msg.push_back(static_cast<char>(all[r * kMaxMessage + i]));
    }
    messages.push_back(std::move(msg));
  }
  return messages;
}

void agree_on_host(const HandleConfig& cfg, const std::string& op, const std::string& local_error) {
  const std::string mine = identity(cfg, op);
  const auto messages = gather_messages(cfg, mine + kSeparator + local_error);
  std::vector<std::string> ran, errors;
  bool mismatch = false;
  for (const auto& m : messages) {
    const size_t cut = m.find(kSeparator);
    ran.push_back(m.substr(0, cut));
    errors.push_back(cut == std::string::npos ? std::string() : m.substr(cut + 1));
    mismatch = mismatch || ran.back() != mine;
  }
  if (mismatch) {
    std::ostringstream msg;
    msg << "te_ep." << op << ": the ranks of group '" << cfg.group_name
        << "' ran different ops or handles, so no data moved (every rank raises):";
    for (size_t r = 0; r < ran.size(); ++r) msg << "\n  rank " << r << ": " << ran[r];
    TORCH_CHECK(false, msg.str());
  }
  std::ostringstream others;
  bool any = false;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty() || static_cast<int64_t>(r) == cfg.rank) continue;
    any = true;
    others << "\n  rank " << r << ": " << errors[r];
  }
  if (!local_error.empty()) {
    TORCH_CHECK(false, local_error, any ? "\nother ranks also failed:" : "", others.str());
  }
  TORCH_CHECK(!any, "te_ep.", op, " failed on another rank of group '", cfg.group_name, "':", others.str());
}

}  // namespace te_ep
