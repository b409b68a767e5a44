// The element types of the buffers that the framework-free code (permutation
// kernels, the NCCL EP wrapper) works on: one enum for both. The one mapping
// from torch's ScalarType is te_ep::dtype_of in csrc/common/scalar_type.h.
#pragma once

#include <cstddef>

namespace te_ep {

enum class DType : int { kFloat32, kFloat16, kBFloat16, kInt32, kInt64 };

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

// Token rows (permutation, dispatch, combine) are one of these.
constexpr bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

}  // namespace te_ep
