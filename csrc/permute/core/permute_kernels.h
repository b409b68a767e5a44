// CUDA launchers of the permutation primitives. Same contracts as the CPU
// kernels in permute.h, except that nothing here synchronizes with the host,
// so data-dependent errors cannot be raised:
//   * expert ids outside [-1, E) are treated as dropped (-1);
//   * rows past `capacity` are dropped and reported through required_rows;
//   * chunk sizes < 0 count as 0, sorted_index entries outside
//     [0, num_chunks) select an empty chunk, and a chunk layout that does not
//     fit in the rows yields -1 (zero rows) in row_map; a sorted_index with
//     repeated entries gives an unspecified (but in-bounds) row_map.
// Every launcher enqueues on `stream` and returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "permute/core/permute.h"

namespace te_ep {
namespace permutation {

// Largest C (choices per token, i.e. K, or E for a routing map): the
// per-token kernels keep a token's C slots in 12 * C bytes of shared memory.
constexpr int64_t kMaxChoicesCuda = 2048;

// Bytes of scratch build_permute_map_cuda needs; the caller allocates them on
// the device (no alignment beyond 16 bytes is required).
size_t permute_map_workspace_bytes(const Routing& routing, int64_t num_experts);

// Like build_permute_map_cpu, plus required_rows[0] (int64, on the device).
cudaError_t build_permute_map_cuda(const Routing& routing, int64_t num_experts, int64_t capacity, int64_t alignment,
                                   int32_t* row_id_map, int32_t* src_slot, int32_t* expert_counts,
                                   int64_t* required_rows, void* workspace, cudaStream_t stream);

cudaError_t permute_rows_cuda(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden,
                              int64_t num_choices, const int32_t* row_id_map, const float* scale, const float* probs,
                              int64_t capacity, const int32_t* src_slot, void* out, float* out_probs,
                              cudaStream_t stream);

cudaError_t unpermute_rows_cuda(const void* input, DType dtype, int64_t num_tokens, int64_t hidden,
                                int64_t num_choices, const int32_t* row_id_map, const float* scale, void* out,
                                cudaStream_t stream);

cudaError_t gather_values_cuda(const int32_t* index, int64_t n, const float* values, float* out, cudaStream_t stream);

cudaError_t unpermute_probs_grad_cuda(const void* grad_out, const void* input, DType dtype, int64_t num_tokens,
                                      int64_t hidden, int64_t num_choices, const int32_t* row_id_map,
                                      float* grad_probs, cudaStream_t stream);

size_t chunk_map_workspace_bytes(int64_t num_chunks);

cudaError_t build_chunk_map_cuda(const void* split_sizes, IndexType sizes_type, const void* sorted_index,
                                 IndexType index_type, int64_t num_chunks, int64_t num_rows, int32_t* row_map,
                                 void* workspace, cudaStream_t stream);

cudaError_t gather_rows_cuda(const void* input, DType dtype, int64_t num_rows, int64_t hidden, const int32_t* index,
                             const float* probs, void* out, float* out_probs, cudaStream_t stream);

}  // namespace permutation
}  // namespace te_ep
