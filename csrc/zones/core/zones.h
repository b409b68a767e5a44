// Row-wise work on an expert-major receive buffer that is bounded by the rows
// in use, not by its capacity (docs/ops.md, "Zone ops"). The rows in use are
// the zones of the local experts, counts[0] + ... + counts[E-1] rows (padding
// included), summed on the device by every kernel: no host sync, capturable
// in a CUDA graph. Rows past them are neither read nor written (their content
// is unspecified), so a buffer sized for the worst case costs memory, never
// time. The scale and bias kernels compute in float32 and round once to the row
// dtype; the gates round after each step of the models' eager expression, as
// that expression does in the row dtype (so te_ep's experts give the model's
// own results; float32 is unaffected).
#pragma once

#include <cstdint>

#include "common/core/dtype.h"

#if TE_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace te_ep {
namespace zones {

// The gate of a gated expert FFN, applied to its gate and up projections:
//   kSilu:    h = silu(gate) * up                                     (SwiGLU)
//   kClamped: g = min(gate, limit), u = clamp(up, -limit, limit),
//             h = (u + 1) * g * sigmoid(alpha * g)                    (gpt-oss)
enum class Gate : int { kSilu = 0, kClamped = 1 };

struct GateSpec {
  Gate gate = Gate::kSilu;
  float alpha = 1.0f;
  float limit = 0.0f;
};

// Where the gate's two operands (or their gradients) are: element (r, c) of the
// gate at gate[r * ld + c * step], of up at up[r * ld + c * step]. The halves of
// one [rows, 2F] tensor, its interleaved columns, or two [rows, F] tensors.
template <typename P>
struct GluPair {
  P gate;
  P up;
  int64_t ld;
  int64_t step;
};

// Zones of more local experts than this are refused by the adapters (the
// kernels keep the zone bounds in shared memory).
constexpr int64_t kMaxZones = 1024;

#if TE_EP_WITH_CUDA
// h [rows, F] (contiguous) from the gate and up operands.
cudaError_t glu_cuda(GluPair<const void*> in, DType dtype, int64_t rows, int64_t ffn, const int32_t* counts,
                     int64_t zones, GateSpec spec, void* h, cudaStream_t stream);
// The operands' gradients from grad_h [rows, F] (contiguous) and the forward operands.
cudaError_t glu_bwd_cuda(const void* grad_h, GluPair<const void*> in, DType dtype, int64_t rows, int64_t ffn,
                         const int32_t* counts, int64_t zones, GateSpec spec, GluPair<void*> grad,
                         cudaStream_t stream);
// out [rows, N] = y + bias[zone of the row]   (bias [zones, N], same dtype).
cudaError_t bias_cuda(const void* y, const void* bias, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                      int64_t zones, void* out, cudaStream_t stream);
// grad_bias [zones, N] = per-zone column sums of grad [rows, N] (float32
// accumulation in row order: bitwise repeatable), in the grad's dtype.
cudaError_t bias_bwd_cuda(const void* grad, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                          int64_t zones, void* grad_bias, cudaStream_t stream);
// out [rows, N] = a + b in float32, rounded to their dtype (the sum autograd makes of
// two gradients of one tensor, bounded by the rows in use).
cudaError_t add_cuda(const void* a, const void* b, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                     int64_t zones, void* out, cudaStream_t stream);
// out [rows, H] = y * w[row] in float32, rounded to y's dtype.
cudaError_t scale_cuda(const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden, const int32_t* counts,
                       int64_t zones, void* out, cudaStream_t stream);
// grad_y = grad * w[row]; grad_w[row] = sum over the row of grad * y (float32),
// 0 on the rows past the zones (grad_w is [rows], as small as the weights).
cudaError_t scale_bwd_cuda(const void* grad, const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden,
                           const int32_t* counts, int64_t zones, void* grad_y, float* grad_w, cudaStream_t stream);
#endif

}  // namespace zones
}  // namespace te_ep
