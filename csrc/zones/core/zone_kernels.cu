// CUDA kernels of csrc/zones/core/zones.h. A block owns a row at a time (grid-
// stride over the rows in use, whose number every block sums from the zone
// counts) and its threads stride over the columns, V elements an access: 16
// bytes where every row start and the width allow it (V = 8 in bfloat16), else
// one element (V = 1: the same arithmetic on each element, so the same bits).
// A block past the rows in use returns at once, so the work follows the routed
// rows whatever the buffer's capacity; the grid is the blocks the GPU holds at
// once, so no second wave leaves SMs idle.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "zones/core/zones.h"

namespace te_ep {
namespace zones {

namespace {

constexpr int kThreads = 256;

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

// V elements of T, loaded or stored as one access (16 bytes when V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V, typename T>
__device__ inline void load(const T* p, float (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = as_float(pk.v[i]);
}

template <int V, typename T>
__device__ inline void store(T* p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

template <typename T>
__device__ inline float glu_value(float g, float u, const GateSpec& spec) {
  if (spec.gate == Gate::kSilu) return rnd<T>(g * sigmoid(g)) * u;  // silu(g) * u
  const float gc = fminf(g, spec.limit);
  const float uc = fminf(fmaxf(u, -spec.limit), spec.limit);
  const float glu = rnd<T>(gc * rnd<T>(sigmoid(rnd<T>(gc * spec.alpha))));
  return rnd<T>(uc + 1.0f) * glu;  // (u + 1) * (g * sigmoid(g * alpha))
}

// The gradient of glu_value's expression, step by step as autograd takes it (each
// step's result rounded to T).
template <typename T>
__device__ inline void glu_grad(float g, float u, float d, const GateSpec& spec, float& dg, float& du) {
  if (spec.gate == Gate::kSilu) {
    const float s = sigmoid(g);
    du = d * rnd<T>(g * s);
    dg = rnd<T>(d * u) * s * (1.0f + g * (1.0f - s));
    return;
  }
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

// Element (row, c) of an operand pair is at row * ld + c * step (step 1 when V > 1).
template <typename T, int V>
__global__ void glu_kernel(GluPair<const T*> in, int64_t rows, int64_t ffn, const int32_t* counts, int64_t zones,
                           GateSpec spec, T* h) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    for (int64_t c = threadIdx.x * V; c < ffn; c += blockDim.x * V) {
      const int64_t at = row * in.ld + c * in.step;
      float g[V], u[V], v[V];
      load<V>(in.gate + at, g);
      load<V>(in.up + at, u);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = glu_value<T>(g[i], u[i], spec);
      store<V>(h + row * ffn + c, v);
    }
  }
}

template <typename T, int V>
__global__ void glu_bwd_kernel(const T* grad_h, GluPair<const T*> in, int64_t rows, int64_t ffn,
                               const int32_t* counts, int64_t zones, GateSpec spec, GluPair<T*> grad) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    for (int64_t c = threadIdx.x * V; c < ffn; c += blockDim.x * V) {
      const int64_t at = row * in.ld + c * in.step;
      float g[V], u[V], d[V], dg[V], du[V];
      load<V>(in.gate + at, g);
      load<V>(in.up + at, u);
      load<V>(grad_h + row * ffn + c, d);
#pragma unroll
      for (int i = 0; i < V; ++i) glu_grad<T>(g[i], u[i], d[i], spec, dg[i], du[i]);
      const int64_t to = row * grad.ld + c * grad.step;
      store<V>(grad.gate + to, dg);
      store<V>(grad.up + to, du);
    }
  }
}

template <typename T, int V>
__global__ void bias_kernel(const T* y, const T* bias, int64_t rows, int64_t n, const int32_t* counts, int64_t zones, T* out) {
  __shared__ int64_t ends[kMaxZones];
  const int64_t total = zone_ends(counts, zones, rows, ends);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const T* b = bias + zone_of(row, ends, zones) * n;
    for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
      float x[V], bv[V];
      load<V>(y + row * n + c, x);
      load<V>(b + c, bv);
#pragma unroll
      for (int i = 0; i < V; ++i) x[i] += bv[i];
      store<V>(out + row * n + c, x);
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

template <typename T, int V>
__global__ void add_kernel(const T* a, const T* b, int64_t rows, int64_t n, const int32_t* counts, int64_t zones,
                           T* out) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
      float x[V], y[V];
      load<V>(a + row * n + c, x);
      load<V>(b + row * n + c, y);
#pragma unroll
      for (int i = 0; i < V; ++i) x[i] += y[i];
      store<V>(out + row * n + c, x);
    }
  }
}

template <typename T, int V>
__global__ void scale_kernel(const T* y, const float* w, int64_t rows, int64_t hidden, const int32_t* counts, int64_t zones, T* out) {
  const int64_t total = rows_in_use(counts, zones, rows);
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const float s = w[row];
    for (int64_t c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
      float x[V];
      load<V>(y + row * hidden + c, x);
#pragma unroll
      for (int i = 0; i < V; ++i) x[i] *= s;
      store<V>(out + row * hidden + c, x);
    }
  }
}

// grad_y's row, and the row's dot product: each warp's part reduced with
// shuffles, the warps' parts by the first thread (two sets of partial sums,
// alternating by row, so one barrier a row suffices).
template <typename T, int V>
__global__ void scale_bwd_kernel(const T* grad, const T* y, const float* w, int64_t rows, int64_t hidden,
                                 const int32_t* counts, int64_t zones, T* grad_y, float* grad_w) {
  __shared__ float partial[2][kThreads / 32];
  const int64_t total = rows_in_use(counts, zones, rows);
  // grad_w covers every row (it is [rows] floats: a few bytes a row); the
  // [rows, hidden] work stops at the rows in use.
  for (int64_t row = total + blockIdx.x * blockDim.x + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    grad_w[row] = 0.0f;
  }
  int set = 0;
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x, set ^= 1) {
    const float s = w[row];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
      float g[V], x[V], gy[V];
      load<V>(grad + row * hidden + c, g);
      load<V>(y + row * hidden + c, x);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        gy[i] = g[i] * s;
        dot += g[i] * x[i];
      }
      store<V>(grad_y + row * hidden + c, gy);
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(0xffffffffu, dot, offset);
    if (threadIdx.x % 32 == 0) partial[set][threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) sum += partial[set][i];
      grad_w[row] = sum;
    }
  }
}

// Threads for rows of `cols` elements, `vec` an access: enough for one row's
// accesses, a multiple of a warp, at most kThreads.
int threads_for(int64_t cols, int vec) {
  const int64_t accesses = (cols + vec - 1) / vec;
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (accesses + 31) / 32 * 32)));
}

// Blocks of `threads` for `units` rows (or row groups): as many of `kernel`'s
// as the device holds at once, at most one a unit.
template <typename K>
int blocks_for(K kernel, int64_t units, int threads) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // the launch reports what went wrong
    sms = 1;
    per_sm = 1;
  }
  const int64_t resident = static_cast<int64_t>(sms) * std::max(1, per_sm);
  return static_cast<int>(std::max<int64_t>(1, std::min(units, resident)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// V for rows of `cols` elements of T at these addresses: 16 bytes per access
// where every row start is 16-byte aligned (the pointers, and the row stride
// `ld` in elements), else 1.
template <typename T>
int vec_for(int64_t cols, int64_t ld, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0 || ld % kVec != 0) return 1;
  for (const void* p : ptrs) {
    if (!aligned16(p)) return 1;
  }
  return kVec;
}

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

// Calls f with std::integral_constant<int, V> for V = 16 / sizeof(T) or 1.
template <typename T, typename F>
void with_vec(int vec, F&& f) {
  if (vec > 1) {
    f(std::integral_constant<int, 16 / sizeof(T)>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
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
    const int vec = in.step == 1 ? vec_for<T>(ffn, in.ld, {in.gate, in.up, h}) : 1;
    with_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(ffn, V);
      const auto kernel = glu_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          typed<const T*>(in), rows, ffn, counts, zones, spec, static_cast<T*>(h));
    });
  });
}

cudaError_t glu_bwd_cuda(const void* grad_h, GluPair<const void*> in, DType dtype, int64_t rows, int64_t ffn,
                         const int32_t* counts, int64_t zones, GateSpec spec, GluPair<void*> grad,
                         cudaStream_t stream) {
  if (rows == 0 || ffn == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int vec = in.step == 1 && grad.step == 1 && vec_for<T>(ffn, grad.ld, {grad.gate, grad.up}) > 1
                        ? vec_for<T>(ffn, in.ld, {in.gate, in.up, grad_h})
                        : 1;
    with_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(ffn, V);
      const auto kernel = glu_bwd_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          static_cast<const T*>(grad_h), typed<const T*>(in), rows, ffn, counts, zones, spec, typed<T*>(grad));
    });
  });
}

cudaError_t bias_cuda(const void* y, const void* bias, DType dtype, int64_t rows, int64_t n, const int32_t* counts,
                      int64_t zones, void* out, cudaStream_t stream) {
  if (rows == 0 || n == 0 || zones == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_vec<T>(vec_for<T>(n, n, {y, bias, out}), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(n, V);
      const auto kernel = bias_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          static_cast<const T*>(y), static_cast<const T*>(bias), rows, n, counts, zones, static_cast<T*>(out));
    });
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
    with_vec<T>(vec_for<T>(n, n, {a, b, out}), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(n, V);
      const auto kernel = add_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          static_cast<const T*>(a), static_cast<const T*>(b), rows, n, counts, zones, static_cast<T*>(out));
    });
  });
}

cudaError_t scale_cuda(const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden, const int32_t* counts,
                       int64_t zones, void* out, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_vec<T>(vec_for<T>(hidden, hidden, {y, out}), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(hidden, V);
      const auto kernel = scale_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          static_cast<const T*>(y), w, rows, hidden, counts, zones, static_cast<T*>(out));
    });
  });
}

cudaError_t scale_bwd_cuda(const void* grad, const void* y, const float* w, DType dtype, int64_t rows, int64_t hidden,
                           const int32_t* counts, int64_t zones, void* grad_y, float* grad_w, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_vec<T>(vec_for<T>(hidden, hidden, {grad, y, grad_y}), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int threads = threads_for(hidden, V);
      const auto kernel = scale_bwd_kernel<T, V>;
      kernel<<<blocks_for(kernel, rows, threads), threads, 0, stream>>>(
          static_cast<const T*>(grad), static_cast<const T*>(y), w, rows, hidden, counts, zones,
          static_cast<T*>(grad_y), grad_w);
    });
  });
}

}  // namespace zones
}  // namespace te_ep
