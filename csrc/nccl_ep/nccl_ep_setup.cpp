// Setting the nccl_ep backend up and down: NCCL EP loaded, a new handle's
// arguments checked against what NCCL EP takes, the NCCL communicator and
// NCCL EP group it runs on (one communicator per torch process group; the
// handles that agree on their sizes and mode share a group), the mode it runs
// in (zero-copy or staged), and the release of a torch group's communicator
// and groups. NcclEpBackend itself: nccl_ep_backend.h.
#include "nccl_ep/nccl_ep_backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cuda.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "comm/core/routing.h"
#include "nccl_ep/core/nccl_ep_runtime.h"
#include "watchdog/core/watchdog.h"

namespace te_ep {

namespace {

namespace ne = nccl_ep;

constexpr int64_t kRowAlignmentBytes = 16;

// The bootstrap of our NCCL communicator runs through the torch process group:
// on its CUDA backend when it has one (NCCL), else on its CPU backend.
at::Device collective_device(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Device& cuda_device) {
  for (const auto& device : pg->getDeviceTypes()) {
    if (device.is_cuda()) return cuda_device;
  }
  return at::Device(at::kCPU);
}

ne::UniqueId broadcast_unique_id(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Device& device) {
  ne::UniqueId id{};
  if (pg->getRank() == 0) id = ne::make_unique_id();
  at::Tensor host = at::empty({static_cast<int64_t>(id.size())}, at::kByte);
  std::memcpy(host.data_ptr(), id.data(), id.size());
  std::vector<at::Tensor> buffers{host.to(collective_device(pg, device))};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  pg->broadcast(buffers, options)->wait();
  at::Tensor received = buffers[0].cpu();
  std::memcpy(id.data(), received.data_ptr(), id.size());
  return id;
}

// Groups with the same key share one ncclEpGroup. NCCL EP sizes its receive
// budget and staging buffers per group (max_recv_tokens_per_rank,
// max_token_bytes), while our handles each choose capacity, hidden and dtype.
// One group per distinct key gives every handle exactly its own capacity, and
// layers of one model (which almost always agree on these) share a group.
struct GroupKey {
  int64_t num_experts;
  int64_t max_tokens_per_rank;
  int64_t capacity;
  int64_t max_token_bytes;
  bool can_overflow;
  bool zero_copy;
  int64_t timeout_ms;

  bool operator<(const GroupKey& other) const {
    return std::tie(num_experts, max_tokens_per_rank, capacity, max_token_bytes, can_overflow, zero_copy, timeout_ms) <
           std::tie(other.num_experts, other.max_tokens_per_rank, other.capacity, other.max_token_bytes,
                    other.can_overflow, other.zero_copy, other.timeout_ms);
  }
};

// What the backend created for one torch process group: one NCCL
// communicator, shared by all its EP groups.
struct TorchGroupEntry {
  int64_t process_group_id = 0;
  std::shared_ptr<ne::Communicator> comm;
  std::map<GroupKey, std::shared_ptr<ne::Group>> groups;
};

class Registry {
 public:
  // Collective on first use of a (torch group, key): creates the
  // communicator and/or the EP group.
  std::shared_ptr<ne::Group> group_for(const HandleConfig& cfg, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       const GroupKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(cfg.group_name);
    // Process-group names can be reused after a group is destroyed; an entry
    // made for an earlier group of the same name must not be picked up.
    if (it != entries_.end() && it->second.process_group_id != pg->getID()) {
      entries_.erase(it);
      it = entries_.end();
    }
    if (it == entries_.end()) {
      TorchGroupEntry entry;
      entry.process_group_id = pg->getID();
      const auto id = broadcast_unique_id(pg, cfg.device);
      entry.comm = std::make_shared<ne::Communicator>(id, pg->getSize(), pg->getRank(), cfg.device.index());
      it = entries_.emplace(cfg.group_name, std::move(entry)).first;
    }
    TorchGroupEntry& entry = it->second;
    TORCH_CHECK(entry.comm->device() == cfg.device.index(), "te_ep.create_handle: the nccl_ep backend of group '",
                cfg.group_name, "' runs on cuda:", entry.comm->device(), ", got a handle on ", cfg.device);
    auto group = entry.groups.find(key);
    if (group == entry.groups.end()) {
      ne::GroupConfig config;
      config.num_experts = key.num_experts;
      config.max_tokens_per_rank = key.max_tokens_per_rank;
      config.capacity = key.capacity;
      config.max_token_bytes = key.max_token_bytes;
      config.can_overflow = key.can_overflow;
      config.zero_copy = key.zero_copy;
      config.timeout_ms = key.timeout_ms;
      group = entry.groups.emplace(key, std::make_shared<ne::Group>(entry.comm, config)).first;
    }
    return group->second;
  }

  void release(const std::string& group_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Dropping our references destroys what no handle holds; live handles
    // keep their group, and groups their communicator, until they go.
    entries_.erase(group_name);
  }

 private:
  std::mutex mutex_;
  std::map<std::string, TorchGroupEntry> entries_;
};

// Never destroyed: at exit NCCL and the CUDA driver may be gone before a
// static destructor would run.
Registry& registry() {
  static auto* instance = new Registry();
  return *instance;
}

// "" if `ptr` is CUDA VMM (cuMem) memory, the kind symmetric windows are made of; else why
// not. Asked through the driver API (cuMemRetainAllocationHandle succeeds only on VMM
// memory), fetched from the runtime so that nothing links libcuda.
std::string not_vmm_memory(void* ptr) {
  using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  void* retain = nullptr;
  void* release = nullptr;
  cudaDriverEntryPointQueryResult found_retain{}, found_release{};
  if (cudaGetDriverEntryPointByVersion("cuMemRetainAllocationHandle", &retain, 12000, cudaEnableDefault,
                                       &found_retain) != cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuMemRelease", &release, 12000, cudaEnableDefault, &found_release) !=
          cudaSuccess ||
      found_retain != cudaDriverEntryPointSuccess || found_release != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return "the CUDA driver does not offer cuMemRetainAllocationHandle (no CUDA VMM)";
  }
  CUmemGenericAllocationHandle handle{};
  if (reinterpret_cast<Retain>(retain)(&handle, ptr) != CUDA_SUCCESS) {
    return "ncclMemAlloc returned memory that is not CUDA VMM (cuMem) memory, as NCCL does with "
           "NCCL_CUMEM_ENABLE=0 or where the driver lacks cuMem";
  }
  reinterpret_cast<Release>(release)(handle);
  return "";
}

// Whether this process can allocate window memory ("" if so, else why).
// Probed once: windows need CUDA VMM (cuMem) memory from ncclMemAlloc, which some
// drivers, containers and NCCL_CUMEM_ENABLE=0 take away (ncclMemAlloc then falls back to
// cudaMalloc, and NCCL EP's zero-copy group creation fails with "invalid usage").
std::string window_memory_unavailable() {
  static const std::string reason = [] {
    void* ptr = nullptr;
    const ncclResult_t result = ne::api().MemAlloc(&ptr, 1 << 21);
    if (result != ncclSuccess) return std::string("ncclMemAlloc failed: ") + ne::api().GetErrorString(result);
    std::string why = not_vmm_memory(ptr);
    ne::api().MemFree(ptr);
    return why;
  }();
  return reason;
}

// Collective (create_handle is): every rank picks the same mode, or every rank raises.
// NCCL EP runs on NCCL's device API in both modes, and that needs CUDA VMM (cuMem) memory:
// where a rank has none (NCCL_CUMEM_ENABLE=0, a driver or container without cuMem) NCCL EP's
// group creation fails with "invalid usage" even staged, so every rank raises here instead,
// saying why. Where every rank has it, windows can be made: `auto` runs zero-copy.
std::pair<bool, std::string> choose_zero_copy(const HandleConfig& cfg) {
  const auto messages = gather_messages(cfg, window_memory_unavailable());
  for (size_t r = 0; r < messages.size(); ++r) {
    TORCH_CHECK(messages[r].empty(), "te_ep.create_handle: backend 'nccl_ep' cannot run on rank ", r, ": ",
                messages[r], ". NCCL EP needs NCCL's device API in every mode (staged too), and that needs CUDA "
                "VMM (cuMem) memory; use backend='reference', or leave NCCL_CUMEM_ENABLE unset");
  }
  if (cfg.nccl_ep_mode == "staged") return {false, "nccl_ep_mode='staged' was requested"};
  return {true, cfg.nccl_ep_mode == "zero_copy" ? "nccl_ep_mode='zero_copy' was requested"
                                                : "symmetric windows are available on every rank"};
}

}  // namespace

std::string load_nccl_ep(const std::string& nccl_ep_lib, const std::string& nccl_lib) {
  const auto& info = ne::load(nccl_ep_lib, nccl_lib);
  return "NCCL EP " + ne::format_version(info.nccl_ep_version) + " (" + info.nccl_ep_path + ") on NCCL " +
         ne::format_version(info.nccl_version) + " (" + info.nccl_path + ", JIT headers in " + info.nccl_home +
         "/include)";
}

bool nccl_ep_built() { return true; }

void nccl_ep_mark_exiting() {
  ne::mark_process_exiting();
  watchdog::stop();
}

std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg) {
  TORCH_CHECK(ne::is_loaded(), "te_ep.create_handle: backend 'nccl_ep' needs NCCL EP loaded; call "
              "te_ep_torch._nccl_ep.load() first (te_ep_torch.EpGroup does this for backend='nccl_ep' and 'auto')");
  TORCH_CHECK(cfg.device.is_cuda() && cfg.device.has_index(),
              "te_ep.create_handle: backend 'nccl_ep' needs a CUDA device with an index, got ", cfg.device);
  const auto* props = at::cuda::getDeviceProperties(cfg.device.index());
  TORCH_CHECK(props->major >= 9, "te_ep.create_handle: backend 'nccl_ep' needs a GPU of compute capability 9.0 "
              "(Hopper) or newer, got ", props->name, " (", props->major, ".", props->minor,
              "); use backend='reference'");
  TORCH_CHECK(cfg.dtype == at::kBFloat16 || cfg.dtype == at::kHalf || cfg.dtype == at::kFloat,
              "te_ep.create_handle: backend 'nccl_ep' supports bfloat16, float16 and float32 tokens, got ", cfg.dtype);
  const int64_t row_bytes = cfg.hidden * static_cast<int64_t>(c10::elementSize(cfg.dtype));
  TORCH_CHECK(row_bytes % kRowAlignmentBytes == 0, "te_ep.create_handle: backend 'nccl_ep' moves token rows in "
              "16-byte units, so hidden * element size must be a multiple of 16, got hidden=", cfg.hidden, " (",
              row_bytes, " bytes of ", cfg.dtype, ")");
  // NCCL EP moves expert weights with 16-byte TMA copies, one float per expert
  // of the node, and asserts (aborting the process) when they are misaligned.
  TORCH_CHECK(cfg.num_experts % kNcclEpExpertMultiple == 0, "te_ep.create_handle: backend 'nccl_ep' needs num_experts "
              "to be a multiple of ", kNcclEpExpertMultiple, " (NCCL EP copies routing weights in 16-byte units), got "
              "num_experts=", cfg.num_experts, "; use backend='reference' for this layer");
  // QUANT_FWD moves rows of scales too, and those must be 16-byte aligned:
  // hidden / 128 floats, a multiple of 4.
  TORCH_CHECK(!cfg.dispatch_dtype.has_value() || cfg.hidden % (kFp8Block * 4) == 0, "te_ep.create_handle: FP8 "
              "dispatch on backend 'nccl_ep' moves rows of hidden / ", kFp8Block, " float32 scales in 16-byte units, "
              "so hidden must be a multiple of ", kFp8Block * 4, ", got hidden=", cfg.hidden,
              "; use backend='reference' or a bfloat16 dispatch for this layer");
  // NCCL EP's send budget per rank (see nccl_ep_capacity_floor).
  const int64_t send_budget = nccl_ep_capacity_floor(cfg.max_tokens_per_rank);
  TORCH_CHECK(cfg.capacity >= send_budget, "te_ep.create_handle: backend 'nccl_ep' needs capacity >= "
              "max_tokens_per_rank rounded up to a multiple of ", kNcclEpExpertMultiple, " (NCCL EP's receive budget "
              "may not be smaller than its send budget), got capacity=", cfg.capacity, " and max_tokens_per_rank=",
              cfg.max_tokens_per_rank, " (rounded: ", send_budget, ")");
  TORCH_CHECK(cfg.capacity <= INT32_MAX && cfg.num_experts <= INT32_MAX && row_bytes <= INT32_MAX,
              "te_ep.create_handle: backend 'nccl_ep' needs capacity, num_experts and hidden row bytes below 2^31, "
              "got capacity=", cfg.capacity, ", num_experts=", cfg.num_experts, ", row bytes=", row_bytes);

  try {
    (void)watchdog::action();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "te_ep.create_handle: ", e.what());
  }

  // Creating the first handle of a group runs collectives (the NCCL
  // communicator, the NCCL EP group) that a lost rank would leave waiting.
  const std::unique_ptr<watchdog::Op> watched = enter_watched_op(cfg, "create_handle", -1);
  auto pg = c10d::resolve_process_group(cfg.group_name);
  TORCH_INTERNAL_ASSERT(pg->getSize() == cfg.ep_size && pg->getRank() == cfg.rank);
  c10::cuda::CUDAGuard guard(cfg.device);
  const int64_t worst_case = common::worst_case_capacity(cfg.ep_size, cfg.max_tokens_per_rank, cfg.top_k,
                                                         cfg.num_local_experts(), cfg.alignment);
  const auto [zero_copy, mode_reason] = choose_zero_copy(cfg);
  const GroupKey key{cfg.num_experts, send_budget, cfg.capacity, row_bytes, cfg.capacity < worst_case, zero_copy,
                     cfg.timeout_ms};
  auto group = registry().group_for(cfg, pg, key);
  return std::make_unique<nccl_ep_backend::NcclEpBackend>(cfg, std::move(group), mode_reason);
}

void release_nccl_ep_group(const std::string& group_name) { registry().release(group_name); }

}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
