#include "fp8/core/fp8.h"

#include <cmath>
#include <vector>

#include "common/core/float_convert.h"
#include "fp8/core/fp8_scale.h"

namespace te_ep {
namespace fp8 {

void quantize_cpu(const void* x, DType dtype, int64_t rows, int64_t hidden, bool pow2_scales, uint8_t* values,
                  float* scales) {
  const int64_t blocks = hidden / kBlock;
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(dtype));
  float v[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = static_cast<const char*>(x) + r * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kBlock; ++i) {
        v[i] = convert::load_float(row, b * kBlock + i, dtype);
        finite = finite && std::isfinite(v[i]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      const float scale = block_scale(amax, finite, pow2_scales);
      scales[r * blocks + b] = scale;
      uint8_t* out = values + r * hidden + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) out[i] = finite ? convert::float_to_e4m3(v[i] / scale) : convert::kE4M3NaN;
    }
  }
}

void dequantize_cpu(const uint8_t* values, const float* scales, int64_t rows, int64_t hidden, DType out_dtype,
                    void* out) {
  const int64_t blocks = hidden / kBlock;
  const int64_t row_bytes = hidden * static_cast<int64_t>(dtype_size(out_dtype));
  for (int64_t r = 0; r < rows; ++r) {
    void* row = static_cast<char*>(out) + r * row_bytes;
    for (int64_t i = 0; i < hidden; ++i) {
      const float value = convert::e4m3_to_float(values[r * hidden + i]) * scales[r * blocks + i / kBlock];
      convert::store_float(row, i, out_dtype, value);
    }
  }
}

}  // namespace fp8
}  // namespace te_ep
