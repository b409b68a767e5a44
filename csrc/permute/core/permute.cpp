#include "permute/core/permute.h"

#include "common/core/float_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace te_ep {
namespace permutation {

namespace {

using convert::load_float;
using convert::store_float;

const char* row_at(const void* base, int64_t row, int64_t row_bytes) {
  return static_cast<const char*>(base) + row * row_bytes;
}

char* row_at(void* base, int64_t row, int64_t row_bytes) { return static_cast<char*>(base) + row * row_bytes; }

int64_t load_index(const void* data, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? static_cast<const int32_t*>(data)[i] : static_cast<const int64_t*>(data)[i];
}

// Expert of slot i, -1 for a dropped slot; sets *invalid for an id outside
// [-1, num_experts).
int64_t expert_of_slot(const Routing& routing, int64_t slot, int64_t num_experts, bool* invalid) {
  if (routing.format == RoutingFormat::kMask) {
    return static_cast<const uint8_t*>(routing.data)[slot] != 0 ? slot % routing.num_choices : -1;
  }
  const int64_t expert = load_index(routing.data, routing.index_type, slot);
  if (expert < -1 || expert >= num_experts) *invalid = true;
  return expert >= 0 && expert < num_experts ? expert : -1;
}

}  // namespace

MapResult build_permute_map_cpu(const Routing& routing, int64_t num_experts, int64_t capacity, int64_t alignment,
                                int32_t* row_id_map, int32_t* src_slot, int32_t* expert_counts) {
  MapResult result;
  const int64_t num_slots = routing.num_tokens * routing.num_choices;
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    bool invalid = false;
    const int64_t expert = expert_of_slot(routing, slot, num_experts, &invalid);
    if (invalid) {
      result.error = "routing holds expert id " +
                     std::to_string(load_index(routing.data, routing.index_type, slot)) + " (token " +
                     std::to_string(slot / routing.num_choices) + ", choice " +
                     std::to_string(slot % routing.num_choices) + "), expected ids in [-1, " +
                     std::to_string(num_experts) + ")";
      return result;
    }
    if (expert >= 0) ++counts[expert];
  }
  std::vector<int64_t> next_row(num_experts);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t padded = round_up(counts[e], alignment);
    next_row[e] = start;
    expert_counts[e] = static_cast<int32_t>(start >= capacity ? 0 : std::min(padded, capacity - start));
    start += padded;
  }
  result.required_rows = start;
  for (int64_t row = 0; row < capacity; ++row) src_slot[row] = -1;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    bool invalid = false;
    const int64_t expert = expert_of_slot(routing, slot, num_experts, &invalid);
    row_id_map[slot] = -1;
    if (expert < 0) continue;
    const int64_t row = next_row[expert]++;
    if (row < capacity) {
      row_id_map[slot] = static_cast<int32_t>(row);
      src_slot[row] = static_cast<int32_t>(slot);
    }
  }
  return result;
}

void permute_rows_cpu(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden, int64_t num_choices,
                      const int32_t* row_id_map, const float* scale, const float* probs, int64_t capacity,
                      const int32_t* src_slot, void* out, float* out_probs) {
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dtype));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const char* src = row_at(tokens, t, row_bytes);
    for (int64_t c = 0; c < num_choices; ++c) {
      const int64_t slot = t * num_choices + c;
      const int32_t row = row_id_map[slot];
      if (row < 0) continue;
      char* dst = row_at(out, row, row_bytes);
      if (scale == nullptr) {
        std::memcpy(dst, src, row_bytes);
      } else {
        for (int64_t i = 0; i < hidden; ++i) store_float(dst, i, dtype, load_float(src, i, dtype) * scale[slot]);
      }
      if (out_probs != nullptr) out_probs[row] = probs[slot];
    }
  }
  for (int64_t row = 0; row < capacity; ++row) {
    if (src_slot[row] >= 0) continue;
    std::memset(row_at(out, row, row_bytes), 0, row_bytes);
    if (out_probs != nullptr) out_probs[row] = 0.f;
  }
}

void unpermute_rows_cpu(const void* input, DType dtype, int64_t num_tokens, int64_t hidden, int64_t num_choices,
                        const int32_t* row_id_map, const float* scale, void* out) {
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dtype));
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < num_choices; ++c) {
      const int64_t slot = t * num_choices + c;
      const int32_t row = row_id_map[slot];
      if (row < 0) continue;
      const char* src = row_at(input, row, row_bytes);
      const float w = scale == nullptr ? 1.f : scale[slot];
      for (int64_t i = 0; i < hidden; ++i) acc[i] += w * load_float(src, i, dtype);
    }
    char* dst = row_at(out, t, row_bytes);
    for (int64_t i = 0; i < hidden; ++i) store_float(dst, i, dtype, acc[i]);
  }
}

void gather_values_cpu(const int32_t* index, int64_t n, const float* values, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = index[i] >= 0 ? values[index[i]] : 0.f;
}

void unpermute_probs_grad_cpu(const void* grad_out, const void* input, DType dtype, int64_t num_tokens,
                              int64_t hidden, int64_t num_choices, const int32_t* row_id_map, float* grad_probs) {
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dtype));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const char* g = row_at(grad_out, t, row_bytes);
    for (int64_t c = 0; c < num_choices; ++c) {
      const int64_t slot = t * num_choices + c;
      const int32_t row = row_id_map[slot];
      float dot = 0.f;
      if (row >= 0) {
        const char* x = row_at(input, row, row_bytes);
        for (int64_t i = 0; i < hidden; ++i) dot += load_float(g, i, dtype) * load_float(x, i, dtype);
      }
      grad_probs[slot] = dot;
    }
  }
}

std::string build_chunk_map_cpu(const void* split_sizes, IndexType sizes_type, const void* sorted_index,
                                IndexType index_type, int64_t num_chunks, int64_t num_rows, int32_t* row_map) {
  std::vector<int64_t> in_offset(num_chunks + 1, 0);
  for (int64_t j = 0; j < num_chunks; ++j) {
    const int64_t size = load_index(split_sizes, sizes_type, j);
    if (size < 0) return "split_sizes[" + std::to_string(j) + "] is negative (" + std::to_string(size) + ")";
    in_offset[j + 1] = in_offset[j] + size;
  }
  if (in_offset[num_chunks] > num_rows) {
    return "split_sizes sum to " + std::to_string(in_offset[num_chunks]) + " rows, more than the " +
           std::to_string(num_rows) + " rows of input";
  }
  std::vector<bool> seen(num_chunks, false);
  for (int64_t j = 0; j < num_chunks; ++j) {
    const int64_t chunk = load_index(sorted_index, index_type, j);
    if (chunk < 0 || chunk >= num_chunks || seen[chunk]) {
      return "sorted_index must be a permutation of [0, " + std::to_string(num_chunks) + "), got " +
             std::to_string(chunk) + " at position " + std::to_string(j);
    }
    seen[chunk] = true;
  }
  int32_t* forward = row_map;
  int32_t* inverse = row_map + num_rows;
  int64_t out_row = 0;
  for (int64_t j = 0; j < num_chunks; ++j) {
    const int64_t chunk = load_index(sorted_index, index_type, j);
    for (int64_t r = in_offset[chunk]; r < in_offset[chunk + 1]; ++r, ++out_row) {
      forward[out_row] = static_cast<int32_t>(r);
      inverse[r] = static_cast<int32_t>(out_row);
    }
  }
  for (; out_row < num_rows; ++out_row) {
    forward[out_row] = static_cast<int32_t>(out_row);
    inverse[out_row] = static_cast<int32_t>(out_row);
  }
  return std::string();
}

void gather_rows_cpu(const void* input, DType dtype, int64_t num_rows, int64_t hidden, const int32_t* index,
                     const float* probs, void* out, float* out_probs) {
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dtype));
  for (int64_t i = 0; i < num_rows; ++i) {
    const int32_t src = index[i];
    if (src >= 0) {
      std::memcpy(row_at(out, i, row_bytes), row_at(input, src, row_bytes), row_bytes);
    } else {
      std::memset(row_at(out, i, row_bytes), 0, row_bytes);
    }
    if (out_probs != nullptr) out_probs[i] = src >= 0 ? probs[src] : 0.f;
  }
}

}  // namespace permutation
}  // namespace te_ep
