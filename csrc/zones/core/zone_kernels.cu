// CUDA kernels of csrc/zones/core/zones.h. A block owns a row at a time (grid-
// stride over the rows in use, whose number every block sums from the zone
// counts) and its threads stride over the columns: a block past the rows in
// use returns at once, so the work follows the routed rows whatever the
// buffer's capacity.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "zones/core/zones.h"

namespace te_ep {
namespace zones {

namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any GPU the package targets; more would only add
// blocks that find no row.
constexpr int64_t kMaxBlocks = 2048;

__device__ inline float as_float(float v) { return v; }
__device__ inline float as_float(__half v) { return __half2float(v); }
__device__ inline float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_float(float v);
template <>
__device__ inline float from_float<float>(float v) { return v; }
template <>
__device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Rows in use: the sum of the zone counts, read once per block (never more
// than the buffer's rows: counts that claim more are the caller's bug, and
// the kernels must still stay inside the buffer).
__device__ inline int64_t rows_in_use(const int32_t* counts, int64_t zones, int64_t rows) {
  __shared__ int64_t total;
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (int64_t z = 0; z < zones; ++z) sum += counts[z];
    total = sum < rows ? sum : rows;
  }
  __syncthreads();
  return total;
}

// Zone ends (exclusive prefix sums shifted by one) in shared memory; returns
// the rows in use.
__device__ inline int64_t zone_ends(const int32_t* counts, int64_t zones, int64_t rows, int64_t* ends) {
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (int64_t z = 0; z < zones; ++z) {
      sum += counts[z];
      ends[z] = sum < rows ? sum : rows;
    }
  }
  __syncthreads();
  return zones > 0 ? ends[zones - 1] : 0;
}

__device__ inline int64_t zone_of(int64_t row, const int64_t* ends, int64_t zones) {
  int64_t lo = 0, hi = zones - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (row < ends[mid]) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// x rounded to T and back: the gates round after each step, as the models' eager
// expressions do in their dtype (identity for float32), so te_ep's experts give the
// results of the model's own experts.
template <typename T>
__device__ inline float rnd(float x) {
  return as_float(from_float<T>(x));
}

template <typename T>
__global__ void glu_kernel(GluPair<const T*> in, int64_t rows, int64_t ffn, const int32_t* counts, int64_t zones,
                           GateSpec spec, T* h) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    T* out = h + row * ffn;
    for (int64_t c = threadIdx.x; c < ffn; c += blockDim.x) {
      const int64_t at = row * in.ld + c * in.step;
      const float g = as_float(in.gate[at]);
      const float u = as_float(in.up[at]);
      float v;
      if (spec.gate == Gate::kSilu) {
        v = rnd<T>(g * sigmoid(g)) * u;  // silu(g) * u
      } else {
        const float gc = fminf(g, spec.limit);
        const float uc = fminf(fmaxf(u, -spec.limit), spec.limit);
        const float glu = rnd<T>(gc * rnd<T>(sigmoid(rnd<T>(gc * spec.alpha))));
        v = rnd<T>(uc + 1.0f) * glu;  // (u + 1) * (g * sigmoid(g * alpha))
      }
      out[c] = from_float<T>(v);
    }
  }
}

// The gradient of glu_kernel's expression, step by step as autograd takes it (each
// step's result rounded to T).
template <typename T>
__global__ void glu_bwd_kernel(const T* grad_h, GluPair<const T*> in, int64_t rows, int64_t ffn,
                               const int32_t* counts, int64_t zones, GateSpec spec, GluPair<T*> grad) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const T* gh = grad_h + row * ffn;
    for (int64_t c = threadIdx.x; c < ffn; c += blockDim.x) {
      const int64_t at = row * in.ld + c * in.step;
      const float g = as_float(in.gate[at]);
      const float u = as_float(in.up[at]);
      const float d = as_float(gh[c]);
      float dg, du;
      if (spec.gate == Gate::kSilu) {
        const float s = sigmoid(g);
        du = d * rnd<T>(g * s);
        dg = rnd<T>(d * u) * s * (1.0f + g * (1.0f - s));
      } else {
        // clamp passes the gradient where the input lies within its bounds (as torch.clamp does).
        const float gc = fminf(g, spec.limit);
        const float uc = fminf(fmaxf(u, -spec.limit), spec.limit);
        const float sg = rnd<T>(sigmoid(rnd<T>(gc * spec.alpha)));
        const float glu = rnd<T>(gc * sg);
        const float d_glu = rnd<T>(d * rnd<T>(uc + 1.0f));
        const float d_sg = rnd<T>(d_glu * gc);
        const float d_ga = rnd<T>(d_sg * sg * (1.0f - sg));
        const float d_gc = rnd<T>(d_glu * sg) + rnd<T>(d_ga * spec.alpha);
        dg = g <= spec.limit ? d_gc : 0.0f;
        du = (u >= -spec.limit && u <= spec.limit) ? d * glu : 0.0f;
      }
      const int64_t to = row * grad.ld + c * grad.step;
      grad.gate[to] = from_float<T>(dg);
      grad.up[to] = from_float<T>(du);
    }
  }
}

template <typename T>
__global__ void bias_kernel(const T* y, const T* bias, int64_t rows, int64_t n, const int32_t* counts, int64_t zones, T* out) {
  __shared__ int64_t ends[kMaxZones];
  const int64_t total = zone_ends(counts, zones, rows, ends);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const T* b = bias + zone_of(row, ends, zones) * n;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      out[row * n + c] = from_float<T>(as_float(y[row * n + c]) + as_float(b[c]));
    }
  }
}

// Block (zone, column tile): each thread sums one column over the zone's rows.
template <typename T>
__global__ void bias_bwd_kernel(const T* grad, int64_t rows, int64_t n, const int32_t* counts, int64_t zones, T* grad_bias) {
  __shared__ int64_t ends[kMaxZones];
  zone_ends(counts, zones, rows, ends);
  const int64_t z = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const int64_t begin = z == 0 ? 0 : ends[z - 1];
  float sum = 0.0f;
  for (int64_t row = begin; row < ends[z]; ++row) sum += as_float(grad[row * n + c]);
  grad_bias[z * n + c] = from_float<T>(sum);
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, int64_t rows, int64_t n, const int32_t* counts, int64_t zones,
                           T* out) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      out[row * n + c] = from_float<T>(as_float(a[row * n + c]) + as_float(b[row * n + c]));
    }
  }
}

template <typename T>
__global__ void scale_kernel(const T* y, const float* w, int64_t rows, int64_t hidden, const int32_t* counts, int64_t zones, T* out) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const float s = w[row];
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      out[row * hidden + c] = from_float<T>(as_float(y[row * hidden + c]) * s);
    }
  }
}

template <typename T>
__global__ void scale_bwd_kernel(const T* grad, const T* y, const float* w, int64_t rows, int64_t hidden,
                                 const int32_t* counts, int64_t zones, T* grad_y, float* grad_w) {
  __shared__ float partial[kThreads / 32];
  const int64_t total = rows_in_use(counts, zones, rows);
  // grad_w covers every row (it is [rows] floats: a few bytes a row); the
  // [rows, hidden] work stops at the rows in use.
  for (int64_t row = total + blockIdx.x * blockDim.x + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    grad_w[row] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const float s = w[row];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      const float g = as_float(grad[row * hidden + c]);
      grad_y[row * hidden + c] = from_float<T>(g * s);
      dot += g * as_float(y[row * hidden + c]);
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(0xffffffffu, dot, offset);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int i = 0; i < kThreads / 32; ++i) sum += partial[i];
      grad_w[row] = sum;
    }
    __syncthreads();
  }
}

int blocks_for(int64_t rows) { return static_cast<int>(std::max<int64_t>(1, std::min(rows, kMaxBlocks))); }

// Calls f with the CUDA element type of `dtype` (a null pointer of it).
template <typename F>
cudaError_t with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(static_cast<float*>(nullptr));
      break;
    case DType::kFloat16:
      f(static_cast<__half*>(nullptr));
      break;
    case DType::kBFloat16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T, typename P>
GluPair<T> typed(GluPair<P> p) {
  return {static_cast<T>(p.gate), static_cast<T>(p.up), p.ld, p.step};
}

cudaError_t glu_cuda(GluPair<const void*> in, DType dtype, int64_t rows, int64_t ffn, const int32_t* counts,
                     int64_t zones, GateSpec spec, void* h, cudaStream_t stream) {
  if (rows == 0 || ffn == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(typed<const T*>(in), rows, ffn, counts, zones, spec,
                                                             static_cast<T*>(h));
  });
}

cudaError_t glu_bwd_cuda(const void* grad_h, GluPair<const void*> in, DType dtype, int64_t rows, int64_t ffn,
                         const int32_t* counts, int64_t zones, GateSpec spec, GluPair<void*> grad,
                         cudaStream_t stream) {
  if (rows == 0 || ffn == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_bwd_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(static_cast<const T*>(grad_h), typed<const T*>(in),
                                                                 rows, ffn, counts, zones, spec, typed<T*>(grad));
  });
}

cudaError_t bias_cuda(const void* y, const void* bias, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                      int64_t zones, void* out, cudaStream_t stream) {
  if (rows == 0 || n == 0 || zones == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(static_cast<const T*>(y), static_cast<const T*>(bias),
                                                              rows, n, counts, zones, static_cast<T*>(out));
  });
}

cudaError_t bias_bwd_cuda(const void* grad, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                          int64_t zones, void* grad_bias, cudaStream_t stream) {
  if (n == 0 || zones == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads), static_cast<unsigned>(zones));
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_bwd_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(grad), rows, n, counts, zones,
                                                      static_cast<T*>(grad_bias));
  });
}

cudaError_t add_cuda(const void* a, const void* b, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                     int64_t zones, void* out, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b), rows,
                                                             n, counts, zones, static_cast<T*>(out));
  });
}

cudaError_t scale_cuda(const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden, const int32_t* counts,
                       int64_t zones, void* out, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(static_cast<const T*>(y), w, rows, hidden, counts, zones,
                                                               static_cast<T*>(out));
  });
}

cudaError_t scale_bwd_cuda(const void* grad, const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden,
                           const int32_t* counts, int64_t zones, void* grad_y, float* grad_w, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_bwd_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(y), w, rows, hidden, counts, zones,
        static_cast<T*>(grad_y), grad_w);
  });
}

}  // namespace zones
}  // namespace te_ep
