// Framework-free permutation primitives for MoE token routing: types shared
// by the CPU kernels (permute.cpp) and the CUDA launchers
// (permute_kernels.h), and the CPU kernels themselves. Everything works on
// raw, contiguous, row-major buffers; argument validation is the caller's job
// (csrc/permute/permute_ops.cpp), except for checks that need the data, which
// the CPU kernels report through their return values.
//
// Vocabulary (docs/permutation.md):
//   T  tokens, H hidden size, C choices per token (K for top-k ids, E for a
//   boolean routing map), E experts.
//   slot       a choice (t, c), numbered t * C + c.
//   row_id_map [T, C] int32: output row of each slot, -1 when the slot is
//              dropped (id -1 or routing map false) or did not fit in capacity.
//   src_slot   [capacity] int32: slot that owns each output row, -1 for
//              alignment padding and unused rows (which are zero).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/core/dtype.h"

namespace te_ep {
namespace permutation {

// Token rows are float32, float16 or bfloat16 (is_floating); the adapter checks.
using te_ep::DType;
using te_ep::dtype_size;

enum class IndexType : int { kInt32, kInt64 };

enum class RoutingFormat : int {
  kTopK,  // [T, K] expert ids (int32 or int64), -1 = dropped
  kMask,  // [T, E] one byte per (token, expert), nonzero = routed
};

struct Routing {
  const void* data = nullptr;
  RoutingFormat format = RoutingFormat::kTopK;
  IndexType index_type = IndexType::kInt64;  // kTopK only
  int64_t num_tokens = 0;
  int64_t num_choices = 0;
};

constexpr int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Result of the CPU map construction. `required_rows` is the padded row count
// the routing needs (sum of the per-expert zones before clipping to
// capacity); `error` is empty unless the routing holds an invalid expert id.
struct MapResult {
  int64_t required_rows = 0;
  std::string error;
};

// Builds row_id_map [T, C], src_slot [capacity] and expert_counts [E] (zone
// sizes including alignment padding, clipped to capacity). Zones are laid
// out in expert order; inside a zone rows follow slot order, i.e. token
// index then choice index, so the layout is a pure function of the routing.
// Slots whose row would land at or past `capacity` get -1.
MapResult build_permute_map_cpu(const Routing& routing, int64_t num_experts, int64_t capacity, int64_t alignment,
                                int32_t* row_id_map, int32_t* src_slot, int32_t* expert_counts);

// out[row_id_map[t, c]] = tokens[t] (times scale[t, c] when scale is given),
// out_probs[row_id_map[t, c]] = probs[t, c] when probs is given; rows whose
// src_slot is -1 become zero (and their out_probs 0).
void permute_rows_cpu(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden, int64_t num_choices,
                      const int32_t* row_id_map, const float* scale, const float* probs, int64_t capacity,
                      const int32_t* src_slot, void* out, float* out_probs);

// out[t] = sum over c with row_id_map[t, c] >= 0 of input[row_id_map[t, c]]
// (times scale[t, c] when given), accumulated in float32 in choice order.
void unpermute_rows_cpu(const void* input, DType dtype, int64_t num_tokens, int64_t hidden, int64_t num_choices,
                        const int32_t* row_id_map, const float* scale, void* out);

// out[i] = values[index[i]], or 0 where index[i] is -1.
void gather_values_cpu(const int32_t* index, int64_t n, const float* values, float* out);

// grad_probs[t, c] = <grad_out[t], input[row_id_map[t, c]]> in float32, 0 for
// dropped slots.
void unpermute_probs_grad_cpu(const void* grad_out, const void* input, DType dtype, int64_t num_tokens,
                              int64_t hidden, int64_t num_choices, const int32_t* row_id_map, float* grad_probs);

// Chunk reordering. Input rows are split into consecutive chunks of
// split_sizes[j] rows; the output holds chunk sorted_index[0], then chunk
// sorted_index[1], ...; rows after the last chunk keep their position.
// row_map [2, N]: row_map[0][i] is the input row of output row i,
// row_map[1][r] the output row of input row r. Returns an error message
// (empty when the sizes and order are valid).
std::string build_chunk_map_cpu(const void* split_sizes, IndexType sizes_type, const void* sorted_index,
                                IndexType index_type, int64_t num_chunks, int64_t num_rows, int32_t* row_map);

// out[i] = input[index[i]] (zero row where index[i] is -1); out_probs likewise
// from probs when given.
void gather_rows_cpu(const void* input, DType dtype, int64_t num_rows, int64_t hidden, const int32_t* index,
                     const float* probs, void* out, float* out_probs);

}  // namespace permutation
}  // namespace te_ep
