// The per-block scale rule of csrc/fp8/core/fp8.h, shared by the CPU and CUDA
// quantizers so that both compute it with the same operations.
#pragma once

#include <cmath>

#include "common/core/float_convert.h"

namespace te_ep {
namespace fp8 {

// 2^-149, float32's smallest subnormal: the least scale, so a block of tiny
// inputs never divides by zero.
constexpr float kMinScale = 1.40129846e-45f;

// `amax` is max |x| over a block, `finite` whether the block held only
// finite values.
TE_EP_HOST_DEVICE inline float block_scale(float amax, bool finite, bool pow2_scales) {
  if (!finite) return convert::bits_to_float(0x7fc00000u);
  if (amax == 0.0f) return 1.0f;
  float scale = fmaxf(amax / convert::kE4M3Max, kMinScale);
  if (pow2_scales) {
    // scale = m * 2^e with m in [0.5, 1): a power of two already when m is
    // 0.5, else the next one up is 2^e. frexp/ldexp are exact.
    int e = 0;
    const float m = frexpf(scale, &e);
    if (m != 0.5f) scale = ldexpf(1.0f, e);
  }
  return scale;
}

}  // namespace fp8
}  // namespace te_ep
