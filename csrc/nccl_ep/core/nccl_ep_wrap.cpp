#include "nccl_ep/core/nccl_ep_wrap.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace te_ep {
namespace nccl_ep {

namespace {

// The header's *_INIT macros are C compound literals with designated
// initializers; spelled out here so this file stays standard C++17.
template <typename T>
T make_struct() {
  T value;
  std::memset(&value, 0, sizeof(value));
  value.size = static_cast<unsigned int>(sizeof(T));
  value.magic = NCCL_EP_MAGIC;
  return value;
}

ncclDataType_t to_nccl(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  throw std::logic_error("te_ep nccl_ep backend: unknown DType");
}

// A tensor descriptor with its own sizes array. ncclEpTensor_t points at the
// sizes, so the descriptor must not be copied or moved.
class Desc {
 public:
  Desc(const void* data, ncclDataType_t dtype, size_t dim0) : sizes_{dim0, 0} { init(data, dtype, 1); }
  Desc(const void* data, ncclDataType_t dtype, size_t dim0, size_t dim1) : sizes_{dim0, dim1} {
    init(data, dtype, 2);
  }
  // A window-backed tensor carries its window and offset, and also its local
  // address (the window's base plus the offset), which NCCL EP would
  // otherwise look up (ncclWinGetUserPtr) on every call.
  Desc(const Rows& rows, ncclDataType_t dtype, size_t dim0, size_t dim1) : sizes_{dim0, dim1} {
    init(rows.data, dtype, 2);
    tensor_.win_hdl = rows.win;
    tensor_.win_offset = rows.win == nullptr ? 0 : rows.offset;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  ncclEpTensor_t* get() { return &tensor_; }

 private:
  void init(const void* data, ncclDataType_t dtype, unsigned int ndim) {
    std::memset(&tensor_, 0, sizeof(tensor_));
    tensor_.size = NCCL_EP_TENSOR_SIZE;
    tensor_.magic = NCCL_EP_TENSOR_MAGIC;
    tensor_.ndim = ndim;
    tensor_.datatype = dtype;
    // NCCL EP takes non-const descriptors for inputs too; it does not write them.
    tensor_.data = const_cast<void*>(data);
    tensor_.sizes = sizes_;
  }

  size_t sizes_[2];
  ncclEpTensor_t tensor_;
};

size_t to_size(int64_t value) { return static_cast<size_t>(value); }

// Restores the calling thread's current device on scope exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (device >= 0 && device != previous_) cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace


UniqueId make_unique_id() {
  ncclUniqueId id;
  check_nccl(api().GetUniqueId(&id), "ncclGetUniqueId");
  UniqueId out;
  static_assert(sizeof(id.internal) == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId layout changed");
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

Communicator::Communicator(const UniqueId& id, int nranks, int rank, int device) : device_(device) {
  ncclUniqueId nccl_id;
  std::memcpy(nccl_id.internal, id.data(), id.size());
  DeviceScope scope(device);
  check_nccl(api().CommInitRank(&comm_, nranks, nccl_id, rank), "ncclCommInitRank");
}

Communicator::~Communicator() {
  if (comm_ == nullptr || process_exiting()) return;
  DeviceScope scope(device_);
  for (const Window& w : windows_) {
    api().CommWindowDeregister(comm_, w.win);
    api().MemFree(w.ptr);
  }
  api().CommDestroy(comm_);
}

Communicator::Window Communicator::register_window(size_t bytes) {
  DeviceScope scope(device_);
  Window w;
  w.bytes = bytes;
  check_nccl(api().MemAlloc(&w.ptr, bytes), "ncclMemAlloc (zero-copy window)");
  const ncclResult_t reg = api().CommWindowRegister(comm_, w.ptr, bytes, &w.win, NCCL_WIN_COLL_SYMMETRIC);
  if (reg != ncclSuccess) {
    api().MemFree(w.ptr);
    check_nccl(reg, "ncclCommWindowRegister (zero-copy window)");
  }
  // Rows past a step's total must read as zeros (docs/ops.md); the dirty-row
  // bookkeeping of the backend starts from a clean window.
  if (cudaMemset(w.ptr, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    throw std::runtime_error(std::string("te_ep nccl_ep backend: zeroing a window failed: ") +
                             cudaGetErrorString(cudaGetLastError()));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  windows_.push_back(w);
  return w;
}

void Communicator::all_reduce_sum(int32_t* data, size_t count, cudaStream_t stream) {
  check_nccl(api().AllReduce(data, data, count, ncclInt32, ncclSum, comm_, stream), "ncclAllReduce (device checks)");
}

Group::Group(std::shared_ptr<Communicator> comm, const GroupConfig& config) : comm_(std::move(comm)), config_(config) {
  auto cfg = make_struct<ncclEpGroupConfig_t>();
  cfg.version = NCCL_EP_API_VERSION;
  cfg.algorithm = NCCL_EP_ALGO_HIGH_THROUGHPUT;
  cfg.num_experts = static_cast<unsigned int>(config.num_experts);
  cfg.max_dispatch_tokens_per_rank = static_cast<unsigned int>(config.max_tokens_per_rank);
  // A fixed receive budget (not NCCL_EP_AUTO's eager mode) keeps dispatch
  // outputs static-shaped and capturable in a CUDA graph.
  cfg.max_recv_tokens_per_rank = static_cast<unsigned int>(config.capacity);
  cfg.max_token_bytes = static_cast<unsigned int>(config.max_token_bytes);
  cfg.rdma_buffer_size = NCCL_EP_AUTO;
  cfg.num_qp_per_rank = NCCL_EP_AUTO;
  cfg.num_channels = NCCL_EP_AUTO;
  // max_num_sms would cap every NCCL EP kernel, the local permute/dup and the
  // routing preprocessing included, and those run fastest on all SMs; the SM
  // budget of the communication kernels alone is NCCL EP's NCCL_EP_COMM_SMS.
  cfg.max_num_sms = NCCL_EP_AUTO;
  // TRAP (the default) aborts the process from the device on a capacity
  // overflow, which no rank can turn into an error. DROP keeps the process
  // alive and reports the pre-drop total, from which we raise (see
  // launch_finish_prepare and docs/nccl_ep.md), but zero-fills the whole
  // receive buffer on every dispatch. Where no routing can overflow, TRAP
  // never fires and saves that memset.
  cfg.overflow_policy = config.can_overflow ? NCCL_EP_OVERFLOW_DROP : NCCL_EP_OVERFLOW_TRAP;
  // Explicit OFF rather than AUTO: the staged mode must not change meaning
  // if a later NCCL EP release resolves AUTO differently.
  cfg.zero_copy = config.zero_copy ? NCCL_EP_ZERO_COPY_ON : NCCL_EP_ZERO_COPY_OFF;
  cfg.timeout_ns = static_cast<uint64_t>(config.timeout_ms) * 1000000ULL;
  DeviceScope scope(comm_->device());
  check_nccl(api().EpCreateGroup(&group_, comm_->get(), &cfg), "ncclEpCreateGroup");
}

Group::~Group() {
  if (group_ == nullptr || process_exiting()) return;
  DeviceScope scope(comm_->device());
  api().EpGroupDestroy(group_);
}

size_t Group::handle_mem_size(int64_t alignment, int64_t top_k) const {
  auto hcfg = make_struct<ncclEpHandleConfig_t>();
  hcfg.dispatch_output_per_expert_alignment = to_size(alignment);
  size_t bytes = 0;
  check_nccl(api().EpHandleMemSize(group_, NCCL_EP_LAYOUT_EXPERT_MAJOR, &hcfg, &bytes, static_cast<int>(top_k)),
             "ncclEpHandleMemSize");
  return bytes;
}

Handle::Handle(std::shared_ptr<Group> group, int64_t alignment, int64_t top_k, void* handle_mem,
               size_t handle_mem_bytes)
    : group_(std::move(group)) {
  auto hcfg = make_struct<ncclEpHandleConfig_t>();
  hcfg.dispatch_output_per_expert_alignment = to_size(alignment);
  Desc mem(handle_mem, ncclUint8, handle_mem_bytes);
  DeviceScope scope(group_->comm()->device());
  check_nccl(api().EpInitHandle(&handle_, group_->get(), NCCL_EP_LAYOUT_EXPERT_MAJOR, &hcfg,
                                static_cast<int>(top_k), mem.get()),
             "ncclEpInitHandle");
}

Handle::~Handle() {
  if (handle_ == nullptr || process_exiting()) return;
  api().EpHandleDestroy(handle_);
}

void Handle::update(const void* topk_idx, DType idx_dtype, int64_t num_tokens, int64_t top_k, int32_t* expert_counts,
                    int64_t num_local_experts, int32_t* recv_total, cudaStream_t stream) {
  Desc idx(topk_idx, to_nccl(idx_dtype), to_size(num_tokens), to_size(top_k));
  Desc counts(expert_counts, ncclInt32, to_size(num_local_experts));
  Desc total(recv_total, ncclInt32, 1);
  auto layout = make_struct<ncclEpLayoutInfo_t>();
  layout.expert_counters = counts.get();
  layout.recv_total_counter = total.get();
  check_nccl(api().EpUpdateHandle(handle_, idx.get(), &layout, stream), "ncclEpUpdateHandle");
}

void Handle::dispatch_forward(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden,
                              const float* weights, int64_t top_k, const Rows& recv_tokens, float* recv_weights,
                              cudaStream_t stream) {
  const size_t capacity = to_size(group_->config().capacity);
  Desc in_tokens(tokens, to_nccl(dtype), to_size(num_tokens), to_size(hidden));
  Desc in_weights(weights, ncclFloat32, to_size(num_tokens), to_size(top_k));
  Desc out_tokens(recv_tokens, to_nccl(dtype), capacity, to_size(hidden));
  Desc out_weights(recv_weights, ncclFloat32, capacity);
  auto inputs = make_struct<ncclEpDispatchInputs_t>();
  inputs.tokens = in_tokens.get();
  inputs.topk_weights = in_weights.get();
  auto outputs = make_struct<ncclEpDispatchOutputs_t>();
  outputs.tokens = out_tokens.get();
  outputs.topk_weights = out_weights.get();
  auto config = make_struct<ncclEpDispatchConfig_t>();
  config.pass_direction = NCCL_EP_FWD_PASS;
  check_nccl(api().EpDispatch(handle_, &inputs, &outputs, nullptr, &config, stream), "ncclEpDispatch (forward)");
}

void Handle::dispatch_forward_fp8(const void* values, const float* scales, int64_t num_tokens, int64_t hidden,
                                  int64_t num_scales, const float* weights, int64_t top_k, const Rows& recv_values,
                                  const Rows& recv_scales, float* recv_weights, cudaStream_t stream) {
  const size_t capacity = to_size(group_->config().capacity);
  Desc in_values(values, ncclFloat8e4m3, to_size(num_tokens), to_size(hidden));
  Desc in_scales(scales, ncclFloat32, to_size(num_tokens), to_size(num_scales));
  Desc in_weights(weights, ncclFloat32, to_size(num_tokens), to_size(top_k));
  Desc out_values(recv_values, ncclFloat8e4m3, capacity, to_size(hidden));
  Desc out_scales(recv_scales, ncclFloat32, capacity, to_size(num_scales));
  Desc out_weights(recv_weights, ncclFloat32, capacity);
  auto inputs = make_struct<ncclEpDispatchInputs_t>();
  inputs.tokens = in_values.get();
  inputs.topk_weights = in_weights.get();
  inputs.scales = in_scales.get();
  auto outputs = make_struct<ncclEpDispatchOutputs_t>();
  outputs.tokens = out_values.get();
  outputs.topk_weights = out_weights.get();
  outputs.scales = out_scales.get();
  auto config = make_struct<ncclEpDispatchConfig_t>();
  config.pass_direction = NCCL_EP_FWD_PASS;
  // The caller quantized: NCCL EP forwards values and scales as bytes.
  config.quant_recipe = NCCL_EP_DISP_QUANT_FWD;
  check_nccl(api().EpDispatch(handle_, &inputs, &outputs, nullptr, &config, stream), "ncclEpDispatch (FP8 forward)");
}

void Handle::dispatch_backward(const void* grad_out, DType dtype, int64_t num_tokens, int64_t hidden,
                               const Rows& recv_tokens, cudaStream_t stream) {
  const size_t capacity = to_size(group_->config().capacity);
  Desc in_tokens(grad_out, to_nccl(dtype), to_size(num_tokens), to_size(hidden));
  Desc out_tokens(recv_tokens, to_nccl(dtype), capacity, to_size(hidden));
  auto inputs = make_struct<ncclEpDispatchInputs_t>();
  inputs.tokens = in_tokens.get();
  auto outputs = make_struct<ncclEpDispatchOutputs_t>();
  outputs.tokens = out_tokens.get();
  auto config = make_struct<ncclEpDispatchConfig_t>();
  config.pass_direction = NCCL_EP_BWD_PASS;
  check_nccl(api().EpDispatch(handle_, &inputs, &outputs, nullptr, &config, stream), "ncclEpDispatch (backward)");
}

void Handle::combine_forward(const Rows& expert_out, DType dtype, int64_t hidden, void* out, int64_t num_tokens,
                             cudaStream_t stream) {
  const size_t capacity = to_size(group_->config().capacity);
  Desc in_tokens(expert_out, to_nccl(dtype), capacity, to_size(hidden));
  Desc out_tokens(out, to_nccl(dtype), to_size(num_tokens), to_size(hidden));
  auto inputs = make_struct<ncclEpCombineInputs_t>();
  inputs.tokens = in_tokens.get();
  auto outputs = make_struct<ncclEpCombineOutputs_t>();
  outputs.tokens = out_tokens.get();
  auto config = make_struct<ncclEpCombineConfig_t>();
  config.pass_direction = NCCL_EP_FWD_PASS;
  check_nccl(api().EpCombine(handle_, &inputs, &outputs, &config, stream), "ncclEpCombine (forward)");
}

void Handle::combine_backward(const Rows& grad_recv, const float* grad_recv_weights, DType dtype, int64_t hidden,
                              void* grad_tokens, float* grad_weights, int64_t num_tokens, int64_t top_k,
                              cudaStream_t stream) {
  const size_t capacity = to_size(group_->config().capacity);
  Desc in_tokens(grad_recv, to_nccl(dtype), capacity, to_size(hidden));
  // Expert-major: one weight per slot, the shape dispatch produced.
  Desc in_weights(grad_recv_weights, ncclFloat32, capacity);
  Desc out_tokens(grad_tokens, to_nccl(dtype), to_size(num_tokens), to_size(hidden));
  Desc out_weights(grad_weights, ncclFloat32, to_size(num_tokens), to_size(top_k));
  auto inputs = make_struct<ncclEpCombineInputs_t>();
  inputs.tokens = in_tokens.get();
  inputs.topk_weights = in_weights.get();
  auto outputs = make_struct<ncclEpCombineOutputs_t>();
  outputs.tokens = out_tokens.get();
  outputs.topk_weights = out_weights.get();
  auto config = make_struct<ncclEpCombineConfig_t>();
  config.pass_direction = NCCL_EP_BWD_PASS;
  check_nccl(api().EpCombine(handle_, &inputs, &outputs, &config, stream), "ncclEpCombine (backward)");
}

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
