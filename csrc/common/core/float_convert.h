// Float formats without a framework: half, bfloat16 and float8 e4m3 (fn)
// to and from float32. Every conversion to a narrower format rounds to
// nearest even, like the CUDA intrinsics and PyTorch's CPU conversions, so
// CPU and CUDA kernels agree bit for bit.
//
// The e4m3 codec is host-and-device code: the FP8 quantizers of both devices
// call the same function, so their values are identical by construction.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/core/dtype.h"

#if defined(__CUDACC__)
#define TE_EP_HOST_DEVICE __host__ __device__
#else
#define TE_EP_HOST_DEVICE
#endif

namespace te_ep {
namespace convert {

TE_EP_HOST_DEVICE inline float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

TE_EP_HOST_DEVICE inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// ---- float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities; 0x7f / 0xff are NaN; largest finite 448; smallest subnormal 2^-9.

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7f;

// |f| >= 480 (where rounding would pass 448's neighbour), infinities and NaN
// become NaN with f's sign, as PyTorch's conversion does; callers that must
// not produce NaN keep |f| <= 448.
TE_EP_HOST_DEVICE inline uint8_t float_to_e4m3(float f) {
  uint32_t x = float_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x >= 0x43f00000u) return sign | kE4M3NaN;  // >= 480, inf, NaN
  if (x < 0x3c800000u) {
    // Below 2^-6 (the smallest normal) the code counts units of 2^-9; the
    // scaling is exact and rintf rounds to nearest even.
    return sign | static_cast<uint8_t>(rintf(bits_to_float(x) * 512.0f));
  }
  // Rebias the exponent (127 -> 7) and round away the 20 dropped mantissa bits.
  x += 0xc407ffffu + ((x >> 20) & 1u);
  return sign | static_cast<uint8_t>(x >> 20);
}

TE_EP_HOST_DEVICE inline float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if ((code & 0x7fu) == kE4M3NaN) return bits_to_float(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// ---- half and bfloat16 (host only: device code has the CUDA intrinsics).

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // keep NaN a NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;
  // 65520 is the midpoint between the largest half (65504) and 2^16; ties go
  // to the even neighbour, which is infinity.
  if (x >= 0x477ff000u) return sign | 0x7c00u;
  if (x < 0x38800000u) {
    // Below the smallest normal half the result counts units of 2^-24; the
    // scaling is exact, and nearbyint rounds to nearest even.
    const float units = bits_to_float(x) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(units));
  }
  // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits.
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>(x >> 13);
}

// Element i of a row of a floating DType, as float32.
inline float load_float(const void* row, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(row)[i];
    case DType::kFloat16:
      return fp16_to_float(static_cast<const uint16_t*>(row)[i]);
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
    default:  // not a row type: the adapter has refused it
      break;
  }
  return 0.f;
}

inline void store_float(void* row, int64_t i, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(row)[i] = value;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(row)[i] = float_to_fp16(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(row)[i] = float_to_bf16(value);
      return;
    default:  // not a row type: the adapter has refused it
      return;
  }
}

}  // namespace convert
}  // namespace te_ep
