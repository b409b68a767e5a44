#include "comm/core/routing.h"

#include <algorithm>
#include <sstream>

namespace te_ep {
namespace common {

template <typename Id>
std::string build_send_plan(
    const Id* topk_idx, int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t ep_size,
    SendPlan* plan) {
  const int64_t num_local = num_experts / ep_size;
  const int64_t num_buckets = ep_size * num_local;
  plan->counts.assign(num_buckets, 0);

  for (int64_t t = 0; t < num_tokens; ++t) {
    const Id* row = topk_idx + t * top_k;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t e = static_cast<int64_t>(row[k]);
      if (e == -1) continue;
      if (e < -1 || e >= num_experts) {
        std::ostringstream msg;
        msg << "topk_idx[" << t << ", " << k << "] = " << e
            << " is out of range: expected -1 (dropped choice) or an expert id in [0, " << num_experts << ")";
        return msg.str();
      }
      for (int64_t j = 0; j < k; ++j) {
        if (static_cast<int64_t>(row[j]) == e) {
          std::ostringstream msg;
          msg << "topk_idx row " << t << " names expert " << e << " twice (columns " << j << " and " << k
              << "); the choices of a token must be distinct experts";
          return msg.str();
        }
      }
      // Expert ids are laid out rank-major, so the bucket index is the id.
      ++plan->counts[e];
    }
  }

  // Counting sort by bucket; iterating tokens in order keeps it stable.
  std::vector<int64_t> cursor(num_buckets, 0);
  int64_t running = 0;
  for (int64_t b = 0; b < num_buckets; ++b) {
    cursor[b] = running;
    running += plan->counts[b];
  }
  plan->order.assign(running, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t e = static_cast<int64_t>(topk_idx[t * top_k + k]);
      if (e < 0) continue;
      plan->order[cursor[e]++] = t * top_k + k;
    }
  }
  return "";
}

template std::string build_send_plan<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int64_t, SendPlan*);
template std::string build_send_plan<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t, SendPlan*);

ZoneLayout make_zone_layout(
    const int64_t* recv_counts, int64_t ep_size, int64_t num_local_experts, int64_t alignment) {
  ZoneLayout layout;
  layout.zone_rows.assign(num_local_experts, 0);
  layout.zone_start.assign(num_local_experts, 0);
  for (int64_t e = 0; e < num_local_experts; ++e) {
    int64_t rows = 0;
    for (int64_t s = 0; s < ep_size; ++s) rows += recv_counts[s * num_local_experts + e];
    rows = (rows + alignment - 1) / alignment * alignment;
    layout.zone_start[e] = layout.total;
    layout.zone_rows[e] = rows;
    layout.total += rows;
  }
  return layout;
}

std::vector<int64_t> arrival_slots(
    const int64_t* recv_counts, int64_t ep_size, int64_t num_local_experts, const ZoneLayout& layout) {
  std::vector<int64_t> fill(layout.zone_start);
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < ep_size; ++s) {
    for (int64_t e = 0; e < num_local_experts; ++e) {
      const int64_t n = recv_counts[s * num_local_experts + e];
      for (int64_t j = 0; j < n; ++j) slots.push_back(fill[e]++);
    }
  }
  return slots;
}

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

int64_t worst_case_capacity(
    int64_t ep_size, int64_t max_tokens_per_rank, int64_t top_k, int64_t num_local_experts, int64_t alignment) {
  return ep_size * max_tokens_per_rank * std::min(top_k, num_local_experts) + num_local_experts * (alignment - 1);
}

}  // namespace common
}  // namespace te_ep
