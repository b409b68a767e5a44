// The reference backend: the op contract executed with torch.distributed
// collectives on any process group (gloo on CPU, NCCL on GPUs). It is the
// oracle the NCCL EP backend is tested against, so it favours plainness and
// determinism over speed: routing is planned on the host, rows move with
// all_to_all_single, and sums run in a fixed order in float32.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <sstream>

#include "comm/core/routing.h"
#include "comm/backend.h"

namespace te_ep {
namespace {

// handle_mem layout (int64): a header, the step's send and receive counts,
// and the send order. Everything a later op needs is in it, so the routing
// state flows through the graph as a tensor.
constexpr int64_t kPrepared = 0;  // 1 once a prepare succeeded
constexpr int64_t kNumTokens = 1;
constexpr int64_t kTotal = 2;
constexpr int64_t kHeader = 3;

// Routing of the last prepare, read back on the host.
struct Plan {
  int64_t num_tokens = 0;
  std::vector<int64_t> send_counts;  // [W * E_local]
  std::vector<int64_t> recv_counts;  // [W * E_local]
  std::vector<int64_t> order;        // flat choice index of each sent row
  common::ZoneLayout layout;

  std::vector<int64_t> per_rank(const std::vector<int64_t>& counts, int64_t ep_size) const {
    const int64_t num_local = static_cast<int64_t>(counts.size()) / ep_size;
    std::vector<int64_t> rows(ep_size, 0);
    for (int64_t r = 0; r < ep_size; ++r)
      for (int64_t e = 0; e < num_local; ++e) rows[r] += counts[r * num_local + e];
    return rows;
  }
};

class ReferenceBackend final : public Backend {
 public:
  explicit ReferenceBackend(const HandleConfig& cfg)
      : cfg_(cfg), pg_id_(c10d::resolve_process_group(cfg.group_name)->getID()),
        buckets_(cfg.ep_size * cfg.num_local_experts()) {}

  std::string mode() const override { return "reference"; }

  at::Tensor allocate_handle_mem() override {
    const int64_t n = kHeader + 2 * buckets_ + cfg_.max_tokens_per_rank * cfg_.top_k;
    return at::zeros({n}, at::TensorOptions().dtype(at::kLong).device(cfg_.device));
  }

  bool agree_on_arguments(const char* op, const std::string& local_error) override {
    agree_on_host(cfg_, op, local_error);
    return false;
  }

  std::string validate_routing(const at::Tensor& topk_idx) override {
    return build_plan(topk_idx, &scratch_plan_);
  }

  std::tuple<at::Tensor, at::Tensor> prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) override {
    common::SendPlan plan;
    TORCH_INTERNAL_ASSERT(build_plan(topk_idx, &plan).empty(), "prepare called with unvalidated routing");

    at::Tensor send_counts = at::from_blob(plan.counts.data(), {buckets_}, at::kLong).to(cfg_.device);
    at::Tensor recv_counts = at::empty_like(send_counts);
    std::vector<int64_t> even(cfg_.ep_size, cfg_.num_local_experts());
    pg()->alltoall_base(recv_counts, send_counts, even, even)->wait();
    at::Tensor recv_host = recv_counts.cpu();

    common::ZoneLayout layout =
        common::make_zone_layout(recv_host.data_ptr<int64_t>(), cfg_.ep_size, cfg_.num_local_experts(), cfg_.alignment);
    std::string overflow;
    if (layout.total > cfg_.capacity) {
      std::ostringstream msg;
      msg << "te_ep.prepare: capacity overflow: this rank would receive " << layout.total
          << " rows (alignment padding included) but the handle's capacity is " << cfg_.capacity
          << "; create the handle with a larger capacity (worst case: EpGroup.worst_case_capacity)";
      overflow = msg.str();
    }
    // Forget the old routing first: after a failed prepare the handle has none.
    handle_mem.select(0, kPrepared).fill_(0);
    agree_on_host(cfg_, "prepare", overflow);

    at::Tensor mem = at::zeros({handle_mem.numel()}, at::kLong);
    int64_t* m = mem.data_ptr<int64_t>();
    m[kPrepared] = 1;
    m[kNumTokens] = topk_idx.size(0);
    m[kTotal] = layout.total;
    std::copy(plan.counts.begin(), plan.counts.end(), m + kHeader);
    std::copy(recv_host.data_ptr<int64_t>(), recv_host.data_ptr<int64_t>() + buckets_, m + kHeader + buckets_);
    std::copy(plan.order.begin(), plan.order.end(), m + kHeader + 2 * buckets_);
    handle_mem.copy_(mem);

    at::Tensor counts = at::empty({cfg_.num_local_experts()}, at::kInt);
    for (int64_t e = 0; e < cfg_.num_local_experts(); ++e) counts[e] = layout.zone_rows[e];
    at::Tensor total = at::full({1}, layout.total, at::kInt);
    return {counts.to(cfg_.device), total.to(cfg_.device)};
  }

  std::tuple<at::Tensor, at::Tensor> dispatch(
      const at::Tensor& tokens, const at::Tensor& topk_weights, const at::Tensor& handle_mem) override {
    Plan plan = read_plan(handle_mem);
    at::Tensor order = index_tensor(plan.order);
    at::Tensor rows = tokens.index_select(0, at::floor_divide(order, cfg_.top_k));
    at::Tensor weights = topk_weights.reshape({-1}).index_select(0, order);
    at::Tensor recv_rows = to_experts(rows, plan);
    at::Tensor recv_w = to_experts(weights, plan);
    return {scatter_slots(recv_rows, plan), scatter_slots(recv_w, plan)};
  }

  // Each token's values and scales travel as one row of bytes, so a single
  // exchange moves both and the padding rows come out as zero bytes.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(
      const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      const at::Tensor& handle_mem) override {
    Plan plan = read_plan(handle_mem);
    const int64_t hidden = values.size(1);
    const at::Tensor packed =
        at::cat({values.contiguous().view(at::kByte), scales.contiguous().view(at::kByte)}, /*dim=*/1);
    const at::Tensor order = index_tensor(plan.order);
    const at::Tensor rows = packed.index_select(0, at::floor_divide(order, cfg_.top_k));
    const at::Tensor weights = topk_weights.reshape({-1}).index_select(0, order);
    const at::Tensor recv = scatter_slots(to_experts(rows, plan), plan);
    at::Tensor recv_values = recv.narrow(1, 0, hidden).contiguous().view(at::kFloat8_e4m3fn);
    at::Tensor recv_scales = recv.narrow(1, hidden, recv.size(1) - hidden).contiguous().view(at::kFloat);
    return {recv_values, recv_scales, scatter_slots(to_experts(weights, plan), plan)};
  }

  at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) override {
    Plan plan = read_plan(handle_mem);
    return sum_per_token(to_sources(gather_slots(expert_out, plan), plan), plan, num_tokens);
  }

  std::tuple<at::Tensor, at::Tensor> dispatch_bwd(
      const at::Tensor& grad_recv_tokens, const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
      int64_t num_tokens) override {
    Plan plan = read_plan(handle_mem);
    at::Tensor grad_tokens = sum_per_token(to_sources(gather_slots(grad_recv_tokens, plan), plan), plan, num_tokens);
    at::Tensor back_w = to_sources(gather_slots(grad_recv_weights, plan), plan);
    at::Tensor grad_w = at::zeros({num_tokens * cfg_.top_k}, grad_recv_weights.options());
    grad_w.index_copy_(0, index_tensor(plan.order), back_w);
    return {grad_tokens, grad_w.view({num_tokens, cfg_.top_k})};
  }

  at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) override {
    Plan plan = read_plan(handle_mem);
    at::Tensor order = index_tensor(plan.order);
    at::Tensor rows = grad_out.index_select(0, at::floor_divide(order, cfg_.top_k));
    return scatter_slots(to_experts(rows, plan), plan);
  }

  // Read from handle_mem itself, so the routing state lives in the tensor
  // that flows through the graph and a copy of it is as good as the original.
  int64_t prepared_num_tokens(const at::Tensor& handle_mem) override {
    at::Tensor header = handle_mem.narrow(0, 0, kHeader).cpu();
    const int64_t* m = header.data_ptr<int64_t>();
    return m[kPrepared] == 1 ? m[kNumTokens] : -1;
  }

 private:
  // The handle's process group, looked up per use and never held: handles alive at exit (the
  // registry leaks them) must not keep it, and gloo's worker threads, alive past
  // dist.destroy_process_group(); a worker still freeing a finished collective's Python tensors
  // while the interpreter finalizes aborts the process. A group made later under the same name
  // is not this handle's.
  c10::intrusive_ptr<c10d::ProcessGroup> pg() const {
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    try {
      pg = c10d::resolve_process_group(cfg_.group_name);
    } catch (const c10::Error&) {
    }
    TORCH_CHECK(pg && pg->getID() == pg_id_, "te_ep: the process group '", cfg_.group_name,
                "' of this handle was destroyed (dist.destroy_process_group); create a new EpGroup");
    return pg;
  }

  std::string build_plan(const at::Tensor& topk_idx, common::SendPlan* plan) const {
    at::Tensor idx = topk_idx.cpu();
    if (idx.scalar_type() == at::kInt) {
      return common::build_send_plan(
          idx.data_ptr<int32_t>(), idx.size(0), idx.size(1), cfg_.num_experts, cfg_.ep_size, plan);
    }
    return common::build_send_plan(
        idx.data_ptr<int64_t>(), idx.size(0), idx.size(1), cfg_.num_experts, cfg_.ep_size, plan);
  }

  Plan read_plan(const at::Tensor& handle_mem) const {
    at::Tensor mem = handle_mem.cpu();
    const int64_t* m = mem.data_ptr<int64_t>();
    TORCH_INTERNAL_ASSERT(m[kPrepared] == 1, "routing state read before a successful prepare");
    Plan plan;
    plan.num_tokens = m[kNumTokens];
    plan.send_counts.assign(m + kHeader, m + kHeader + buckets_);
    plan.recv_counts.assign(m + kHeader + buckets_, m + kHeader + 2 * buckets_);
    int64_t sent = 0;
    for (int64_t c : plan.send_counts) sent += c;
    plan.order.assign(m + kHeader + 2 * buckets_, m + kHeader + 2 * buckets_ + sent);
    plan.layout =
        common::make_zone_layout(plan.recv_counts.data(), cfg_.ep_size, cfg_.num_local_experts(), cfg_.alignment);
    TORCH_INTERNAL_ASSERT(plan.layout.total == m[kTotal], "routing state is inconsistent");
    return plan;
  }

  at::Tensor index_tensor(const std::vector<int64_t>& v) const {
    return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kLong)
        .to(cfg_.device, /*non_blocking=*/false, /*copy=*/true);
  }

  // all_to_all_single moves raw bytes, so any dtype travels on any backend
  // (gloo has no bfloat16 all-to-all of its own).
  at::Tensor exchange(const at::Tensor& send, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
    int64_t total = 0;
    for (int64_t r : recv_rows) total += r;
    std::vector<int64_t> row_shape(send.sizes().begin(), send.sizes().end());
    row_shape[0] = total;
    at::Tensor recv = at::empty(row_shape, send.options());
    // Row width from the shape, not from numel: a rank may send or receive no rows.
    int64_t row_bytes = send.element_size();
    for (size_t d = 1; d < row_shape.size(); ++d) row_bytes *= row_shape[d];
    at::Tensor send_bytes = send.contiguous().view(at::kByte).view({send.size(0), row_bytes});
    at::Tensor recv_bytes = recv.view(at::kByte).view({total, row_bytes});
    pg()->alltoall_base(recv_bytes, send_bytes, recv_rows, send_rows)->wait();
    return recv;
  }

  at::Tensor to_experts(const at::Tensor& rows, const Plan& plan) {
    return exchange(rows, plan.per_rank(plan.send_counts, cfg_.ep_size), plan.per_rank(plan.recv_counts, cfg_.ep_size));
  }

  at::Tensor to_sources(const at::Tensor& rows, const Plan& plan) {
    return exchange(rows, plan.per_rank(plan.recv_counts, cfg_.ep_size), plan.per_rank(plan.send_counts, cfg_.ep_size));
  }

  at::Tensor slots(const Plan& plan) const {
    return index_tensor(
        common::arrival_slots(plan.recv_counts.data(), cfg_.ep_size, cfg_.num_local_experts(), plan.layout));
  }

  at::Tensor scatter_slots(const at::Tensor& arrived, const Plan& plan) const {
    std::vector<int64_t> shape(arrived.sizes().begin(), arrived.sizes().end());
    shape[0] = cfg_.capacity;
    at::Tensor out = at::zeros(shape, arrived.options());
    out.index_copy_(0, slots(plan), arrived);
    return out;
  }

  at::Tensor gather_slots(const at::Tensor& buffer, const Plan& plan) const {
    return buffer.index_select(0, slots(plan));
  }

  // Sums each token's returned rows. Rows are first placed at their choice
  // index (t, k), then reduced over k in float32: a fixed order, so repeated
  // runs give bitwise-equal results.
  at::Tensor sum_per_token(const at::Tensor& back, const Plan& plan, int64_t num_tokens) const {
    const int64_t hidden = back.size(1);
    at::Tensor by_choice = at::zeros({num_tokens * cfg_.top_k, hidden}, back.options());
    by_choice.index_copy_(0, index_tensor(plan.order), back);
    return by_choice.view({num_tokens, cfg_.top_k, hidden}).sum(1, /*keepdim=*/false, at::kFloat).to(back.scalar_type());
  }

  HandleConfig cfg_;
  int64_t pg_id_;
  int64_t buckets_;
  common::SendPlan scratch_plan_;
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend(const HandleConfig& cfg) {
  return std::make_unique<ReferenceBackend>(cfg);
}

}  // namespace te_ep
