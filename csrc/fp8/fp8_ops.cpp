// te_ep.quantize_fp8 / te_ep.dequantize_fp8: at::Tensor adapters over the
// block-scaled FP8 kernels of csrc/fp8/core/fp8.h (CPU and CUDA).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "fp8/core/fp8.h"
#include "common/scalar_type.h"

#if TE_EP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#endif

namespace te_ep {
namespace {

using at::Tensor;

DType row_dtype(const char* op, const char* name, at::ScalarType type) {
  const std::optional<DType> dtype = dtype_of(type);
  TORCH_CHECK(dtype && is_floating(*dtype), "te_ep.", op, ": ", name,
              " must be torch.bfloat16, torch.float16 or torch.float32, got ", type);
  return *dtype;
}

void check_rows(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.dim() == 2, "te_ep.", op, ": ", name, " must be 2-D [T, H], got shape ", t.sizes());
  TORCH_CHECK(t.size(1) % fp8::kBlock == 0, "te_ep.", op, ": ", name, ".size(1) (H) must be a multiple of the block "
              "size ", fp8::kBlock, ", got H = ", t.size(1));
}

// Contiguous and 16-byte aligned (the CUDA kernels move 8-element words).
Tensor dense(const Tensor& t) {
  Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

bool on_cuda(const Tensor& t) { return t.device().is_cuda(); }

#if TE_EP_WITH_CUDA
cudaStream_t stream_of(const Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

std::tuple<Tensor, Tensor> quantize_fp8(const Tensor& x, bool pow2_scales) {
  const DType dtype = row_dtype("quantize_fp8", "x", x.scalar_type());
  check_rows("quantize_fp8", "x", x);
  const c10::DeviceGuard guard(x.device());
  const Tensor in = dense(x);
  const int64_t rows = in.size(0);
  const int64_t hidden = in.size(1);
  Tensor values = at::empty({rows, hidden}, in.options().dtype(at::kFloat8_e4m3fn));
  Tensor scales = at::empty({rows, hidden / fp8::kBlock}, in.options().dtype(at::kFloat));
  uint8_t* codes = static_cast<uint8_t*>(values.data_ptr());
  if (on_cuda(in)) {
#if TE_EP_WITH_CUDA
    C10_CUDA_CHECK(fp8::quantize_cuda(in.data_ptr(), dtype, rows, hidden, pow2_scales, codes,
                                      scales.data_ptr<float>(), stream_of(in)));
#endif
  } else {
    fp8::quantize_cpu(in.data_ptr(), dtype, rows, hidden, pow2_scales, codes, scales.data_ptr<float>());
  }
  return {values, scales};
}

Tensor dequantize_fp8(const Tensor& values, const Tensor& scales, at::ScalarType dtype) {
  const char* op = "dequantize_fp8";
  TORCH_CHECK(values.scalar_type() == at::kFloat8_e4m3fn, "te_ep.", op, ": values must be torch.float8_e4m3fn, got ",
              values.scalar_type());
  check_rows(op, "values", values);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "te_ep.", op, ": scales must be torch.float32, got ",
              scales.scalar_type());
  const int64_t blocks = values.size(1) / fp8::kBlock;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == values.size(0) && scales.size(1) == blocks, "te_ep.", op,
              ": scales must have shape [", values.size(0), ", ", blocks, "] (one per ", fp8::kBlock,
              " values of each row), got ", scales.sizes());
  TORCH_CHECK(scales.device() == values.device(), "te_ep.", op, ": scales must be on ", values.device(),
              " (values' device), got ", scales.device());
  const DType out_dtype = row_dtype(op, "dtype", dtype);
  const c10::DeviceGuard guard(values.device());
  const Tensor q = dense(values);
  const Tensor s = scales.contiguous();
  Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  const uint8_t* codes = static_cast<const uint8_t*>(q.data_ptr());
  if (on_cuda(q)) {
#if TE_EP_WITH_CUDA
    C10_CUDA_CHECK(fp8::dequantize_cuda(codes, s.data_ptr<float>(), q.size(0), q.size(1), out_dtype, out.data_ptr(),
                                        stream_of(q)));
#endif
  } else {
    fp8::dequantize_cpu(codes, s.data_ptr<float>(), q.size(0), q.size(1), out_dtype, out.data_ptr());
  }
  return out;
}

}  // namespace

static void register_fp8_ops(torch::Library& m) {
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("dequantize_fp8", &dequantize_fp8);
}

TORCH_LIBRARY_IMPL(te_ep, CPU, m) { register_fp8_ops(m); }

#if TE_EP_WITH_CUDA
TORCH_LIBRARY_IMPL(te_ep, CUDA, m) { register_fp8_ops(m); }
#endif

}  // namespace te_ep
