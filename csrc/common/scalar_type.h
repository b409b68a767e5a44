// torch's ScalarType -> te_ep::DType (csrc/common/core/dtype.h), in one place for
// every adapter. std::nullopt for a type the framework-free code has no name
// for; each caller raises its own error naming the op and the argument.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "common/core/dtype.h"

namespace te_ep {

inline std::optional<DType> dtype_of(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    default:
      return std::nullopt;
  }
}

}  // namespace te_ep
