// Block-scaled FP8 (e4m3) quantization of token rows: the layout FP8
// dispatch moves (docs/ops.md, "FP8"). A row [H] of bfloat16, float16 or
// float32 becomes H float8_e4m3fn values and H / 128 float32 scales, one per
// block of 128 consecutive elements, with x ~= value * scale. Per block, with
// amax = max |x| in float32:
//   scale = max(amax / 448, 2^-149), or with pow2_scales the power of two at
//           or above that (an exact exponent, what UE8M0 scales carry);
//   value = e4m3(x / scale), rounded to nearest even; |x / scale| <= 448;
//   an all-zero block has scale 1 (and zero values);
//   a block holding an inf or a NaN has scale NaN and NaN values (0x7f).
// te_ep_torch.testing.fp8_reference states the same in plain PyTorch, and the
// tests hold both kernels to it bit for bit.
#pragma once

#include <cstdint>

#include "common/core/dtype.h"

#if TE_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace te_ep {
namespace fp8 {

constexpr int64_t kBlock = 128;

// x [rows, hidden] (hidden a multiple of kBlock) -> values [rows, hidden]
// (e4m3 codes), scales [rows, hidden / kBlock].
void quantize_cpu(const void* x, DType dtype, int64_t rows, int64_t hidden, bool pow2_scales, uint8_t* values,
                  float* scales);

// values [rows, hidden], scales [rows, hidden / kBlock] -> out [rows, hidden]
// of out_dtype: value * scale in float32, then rounded to out_dtype.
void dequantize_cpu(const uint8_t* values, const float* scales, int64_t rows, int64_t hidden, DType out_dtype,
                    void* out);

#if TE_EP_WITH_CUDA
// The same on the device; enqueue on `stream` and return the launch status.
cudaError_t quantize_cuda(const void* x, DType dtype, int64_t rows, int64_t hidden, bool pow2_scales,
                          uint8_t* values, float* scales, cudaStream_t stream);
cudaError_t dequantize_cuda(const uint8_t* values, const float* scales, int64_t rows, int64_t hidden,
                            DType out_dtype, void* out, cudaStream_t stream);
#endif

}  // namespace fp8
}  // namespace te_ep
