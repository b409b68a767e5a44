// Framework-free routing arithmetic shared by the backends: bucketing a
// rank's top-k choices by destination, and laying out the expert-major
// receive buffer from the exchanged counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace te_ep {
namespace common {

// What one rank sends in a step.
struct SendPlan {
  // counts[d * num_local_experts + e]: rows sent to rank d for its local expert e.
  std::vector<int64_t> counts;
  // Flat choice index (t * top_k + k) of every sent row, ordered by
  // (destination rank, local expert, token): the order receivers rely on.
  std::vector<int64_t> order;
};

// Validates `topk_idx` (row-major [num_tokens, top_k]) and builds the plan.
// Returns an empty string on success, otherwise a message naming the first
// offending element; `plan` is then unspecified.
template <typename Id>
std::string build_send_plan(
    const Id* topk_idx, int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t ep_size,
    SendPlan* plan);

// The expert-major receive layout of one rank.
struct ZoneLayout {
  std::vector<int64_t> zone_rows;   // [E_local] rows per zone, padding included
  std::vector<int64_t> zone_start;  // [E_local] first row of each zone
  int64_t total = 0;                // sum of zone_rows
};

// `recv_counts[s * num_local_experts + e]`: rows rank s sends us for local expert e.
ZoneLayout make_zone_layout(
    const int64_t* recv_counts, int64_t ep_size, int64_t num_local_experts, int64_t alignment);

// Receive-buffer row of every received row, in arrival order (source rank,
// then local expert, then the sender's token order). Rows of one zone are thus
// ordered by source rank, then token index.
std::vector<int64_t> arrival_slots(
    const int64_t* recv_counts, int64_t ep_size, int64_t num_local_experts, const ZoneLayout& layout);

bool is_power_of_two(int64_t v);

// Capacity that no routing can overflow: every token of every rank sent to
// min(top_k, E_local) local experts, plus the padding of every zone.
int64_t worst_case_capacity(
    int64_t ep_size, int64_t max_tokens_per_rank, int64_t top_k, int64_t num_local_experts, int64_t alignment);

}  // namespace common
}  // namespace te_ep
