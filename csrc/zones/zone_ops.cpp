// te_ep.zone_*: at::Tensor adapters over csrc/zones/core/zones.h. On CUDA the
// kernels sum the zone counts on the device (no host sync, capturable); on
// the CPU the same float32 formulas run as ATen ops on the rows in use.
// Either way the rows past the zones are left as they are (outputs: not
// written), which docs/ops.md ("Zone ops") states as unspecified.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "zones/core/zones.h"
#include "common/scalar_type.h"

#if TE_EP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#endif

namespace te_ep {
namespace {

using at::Tensor;

DType row_dtype(const char* op, const char* name, const Tensor& t) {
  const std::optional<DType> dtype = dtype_of(t.scalar_type());
  TORCH_CHECK(dtype && is_floating(*dtype), "te_ep.", op, ": ", name,
              " must be torch.bfloat16, torch.float16 or torch.float32, got ", t.scalar_type());
  return *dtype;
}

void check_rows(const char* op, const char* name, const Tensor& t, int64_t rows = -1, int64_t cols = -1) {
  TORCH_CHECK(t.dim() == 2, "te_ep.", op, ": ", name, " must be 2-D [rows, columns], got shape ", t.sizes());
  TORCH_CHECK(rows < 0 || t.size(0) == rows, "te_ep.", op, ": ", name, " must have ", rows, " rows, got shape ",
              t.sizes());
  TORCH_CHECK(cols < 0 || t.size(1) == cols, "te_ep.", op, ": ", name, " must have ", cols, " columns, got shape ",
              t.sizes());
}

void check_same(const char* op, const char* name, const Tensor& t, const Tensor& like, const char* like_name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "te_ep.", op, ": ", name, " must be ", like.scalar_type(), " (",
              like_name, "'s dtype), got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), "te_ep.", op, ": ", name, " must be on ", like.device(), " (", like_name,
              "'s device), got ", t.device());
}

void check_counts(const char* op, const Tensor& counts, const Tensor& like) {
  TORCH_CHECK(counts.scalar_type() == at::kInt && counts.dim() == 1, "te_ep.", op,
              ": counts must be a 1-D torch.int32 tensor of zone sizes, got ", counts.scalar_type(), " of shape ",
              counts.sizes());
  TORCH_CHECK(counts.size(0) <= zones::kMaxZones, "te_ep.", op, ": counts has ", counts.size(0),
              " zones, at most ", zones::kMaxZones, " are supported");
  TORCH_CHECK(counts.device() == like.device(), "te_ep.", op, ": counts must be on ", like.device(), ", got ",
              counts.device());
}

void check_weights(const char* op, const Tensor& w, const Tensor& y) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == y.size(0), "te_ep.", op,
              ": weights must be a 1-D torch.float32 tensor of ", y.size(0), " rows, got ", w.scalar_type(),
              " of shape ", w.sizes());
  TORCH_CHECK(w.device() == y.device(), "te_ep.", op, ": weights must be on ", y.device(), ", got ", w.device());
}

zones::GateSpec gate_spec(const char* op, c10::string_view gate, double alpha, double limit) {
  zones::GateSpec spec;
  if (gate == "swiglu") {
    spec.gate = zones::Gate::kSilu;
  } else if (gate == "clamped_swiglu") {
    spec.gate = zones::Gate::kClamped;
    TORCH_CHECK(limit > 0, "te_ep.", op, ": limit must be > 0 for gate='clamped_swiglu', got ", limit);
  } else {
    TORCH_CHECK(false, "te_ep.", op, ": gate must be 'swiglu' or 'clamped_swiglu', got '", std::string(gate), "'");
  }
  spec.alpha = static_cast<float>(alpha);
  spec.limit = static_cast<float>(limit);
  return spec;
}

// CPU: the rows in use, read on the host (the CPU has no device to keep busy).
int64_t cpu_rows_in_use(const Tensor& counts, int64_t rows) {
  return std::min<int64_t>(counts.sum().item<int64_t>(), rows);
}

// The gate's operands: `gate_up` [rows, 2F] (halves, or interleaved columns), or
// `gate_up` = the gate [rows, F] and `up` [rows, F]. Checks them and returns
// (gate view, up view, F).
std::tuple<Tensor, Tensor, int64_t> gate_operands(const char* op, const Tensor& gate_up,
                                                  const std::optional<Tensor>& up, bool interleaved) {
  check_rows(op, "gate_up", gate_up);
  if (up.has_value()) {
    TORCH_CHECK(!interleaved, "te_ep.", op, ": interleaved applies to one gate_up tensor, not to gate_up and up");
    check_rows(op, "up", *up, gate_up.size(0), gate_up.size(1));
    check_same(op, "up", *up, gate_up, "gate_up");
    return {gate_up, *up, gate_up.size(1)};
  }
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "te_ep.", op, ": gate_up must have an even number of columns (gate and up), "
              "got shape ", gate_up.sizes());
  const int64_t ffn = gate_up.size(1) / 2;
  if (interleaved) return {gate_up.slice(1, 0, 2 * ffn, 2), gate_up.slice(1, 1, 2 * ffn, 2), ffn};
  return {gate_up.narrow(1, 0, ffn), gate_up.narrow(1, ffn, ffn), ffn};
}

#if TE_EP_WITH_CUDA
cudaStream_t stream_of(const Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// The kernels' view of (gate, up): both share one row stride and one column step.
template <typename P>
zones::GluPair<P> glu_pair(const Tensor& gate, const Tensor& up) {
  TORCH_INTERNAL_ASSERT(gate.stride(0) == up.stride(0) && gate.stride(1) == up.stride(1));
  return {static_cast<P>(gate.data_ptr()), static_cast<P>(up.data_ptr()), gate.stride(0), gate.stride(1)};
}
#endif

// (gate, up) as the kernels read them: one row stride and one column step for both.
std::tuple<Tensor, Tensor> kernel_operands(const char* op, const Tensor& gate_up, const std::optional<Tensor>& up,
                                           bool interleaved) {
  if (up.has_value()) return {gate_up.contiguous(), up->contiguous()};
  const Tensor base = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  auto [g, u, ffn] = gate_operands(op, base, std::nullopt, interleaved);
  (void)ffn;
  return {g, u};
}

Tensor zone_glu(const Tensor& gate_up, const Tensor& counts, c10::string_view gate, bool interleaved, double alpha,
                double limit, const std::optional<Tensor>& up) {
  const char* op = "zone_glu";
  const DType dtype = row_dtype(op, "gate_up", gate_up);
  auto [g, u, ffn] = gate_operands(op, gate_up, up, interleaved);
  check_counts(op, counts, gate_up);
  const zones::GateSpec spec = gate_spec(op, gate, alpha, limit);
  const c10::DeviceGuard guard(gate_up.device());
  const int64_t rows = gate_up.size(0);
  Tensor h = at::empty({rows, ffn}, gate_up.options());
  if (gate_up.is_cuda()) {
#if TE_EP_WITH_CUDA
    auto [kg, ku] = kernel_operands(op, gate_up, up, interleaved);
    C10_CUDA_CHECK(zones::glu_cuda(glu_pair<const void*>(kg, ku), dtype, rows, ffn, counts.data_ptr<int32_t>(),
                                   counts.size(0), spec, h.data_ptr(), stream_of(kg)));
#endif
    return h;
  }
  (void)dtype;
  // The model's eager expression in gate_up's dtype (the CUDA kernel rounds as it does).
  const int64_t total = cpu_rows_in_use(counts, rows);
  g = g.narrow(0, 0, total);
  u = u.narrow(0, 0, total);
  Tensor v;
  if (spec.gate == zones::Gate::kSilu) {
    v = at::silu(g) * u;
  } else {
    g = g.clamp_max(limit);
    u = u.clamp(-limit, limit);
    v = (u + 1) * (g * at::sigmoid(g * alpha));
  }
  h.narrow(0, 0, total).copy_(v);
  return h;
}

std::tuple<Tensor, Tensor> zone_glu_bwd(const Tensor& grad_h, const Tensor& gate_up, const Tensor& counts,
                                        c10::string_view gate, bool interleaved, double alpha, double limit,
                                        const std::optional<Tensor>& up) {
  const char* op = "zone_glu_bwd";
  const DType dtype = row_dtype(op, "gate_up", gate_up);
  auto [g, u, ffn] = gate_operands(op, gate_up, up, interleaved);
  const int64_t rows = gate_up.size(0);
  check_rows(op, "grad_h", grad_h, rows, ffn);
  check_same(op, "grad_h", grad_h, gate_up, "gate_up");
  check_counts(op, counts, gate_up);
  const zones::GateSpec spec = gate_spec(op, gate, alpha, limit);
  const c10::DeviceGuard guard(gate_up.device());
  // The gradients in the operands' layout: [rows, 2F] for one gate_up, two [rows, F] with up.
  const std::vector<int64_t> grad_shape{rows, up.has_value() ? ffn : 2 * ffn};
  Tensor grad = at::empty(grad_shape, gate_up.options());
  Tensor grad_up = up.has_value() ? at::empty({rows, ffn}, gate_up.options()) : at::empty({0}, gate_up.options());
  auto [out_g, out_u, out_ffn] =
      gate_operands(op, grad, up.has_value() ? std::optional<Tensor>(grad_up) : std::nullopt, interleaved);
  (void)out_ffn;
  if (gate_up.is_cuda()) {
#if TE_EP_WITH_CUDA
    auto [kg, ku] = kernel_operands(op, gate_up, up, interleaved);
    const Tensor gh = grad_h.contiguous();
    C10_CUDA_CHECK(zones::glu_bwd_cuda(gh.data_ptr(), glu_pair<const void*>(kg, ku), dtype, rows, ffn,
                                       counts.data_ptr<int32_t>(), counts.size(0), spec,
                                       glu_pair<void*>(out_g, out_u), stream_of(kg)));
#endif
    return {grad, grad_up};
  }
  (void)dtype;
  // Autograd's steps through the eager expression, in gate_up's dtype.
  const int64_t total = cpu_rows_in_use(counts, rows);
  g = g.narrow(0, 0, total);
  u = u.narrow(0, 0, total);
  const Tensor d = grad_h.narrow(0, 0, total);
  Tensor dg, du;
  if (spec.gate == zones::Gate::kSilu) {
    du = d * at::silu(g);
    dg = at::silu_backward(d * u, g);
  } else {
    const Tensor gc = g.clamp_max(limit);
    const Tensor uc = u.clamp(-limit, limit);
    const Tensor sg = at::sigmoid(gc * alpha);
    const Tensor glu = gc * sg;
    const Tensor d_glu = d * (uc + 1);
    const Tensor d_ga = at::sigmoid_backward(d_glu * gc, sg);
    dg = at::where(g <= limit, d_glu * sg + d_ga * alpha, 0);
    du = at::where((u >= -limit).logical_and(u <= limit), d * glu, 0);
  }
  out_g.narrow(0, 0, total).copy_(dg);
  out_u.narrow(0, 0, total).copy_(du);
  return {grad, grad_up};
}

Tensor zone_bias(const Tensor& y, const Tensor& bias, const Tensor& counts) {
  const char* op = "zone_bias";
  const DType dtype = row_dtype(op, "y", y);
  check_rows(op, "y", y);
  check_counts(op, counts, y);
  check_rows(op, "bias", bias, counts.size(0), y.size(1));
  check_same(op, "bias", bias, y, "y");
  const c10::DeviceGuard guard(y.device());
  const int64_t rows = y.size(0);
  Tensor out = at::empty(y.sizes(), y.options());
  if (y.is_cuda()) {
#if TE_EP_WITH_CUDA
    const Tensor x = y.contiguous();
    const Tensor b = bias.contiguous();
    C10_CUDA_CHECK(zones::bias_cuda(x.data_ptr(), b.data_ptr(), dtype, rows, y.size(1), counts.data_ptr<int32_t>(),
                                    counts.size(0), out.data_ptr(), stream_of(x)));
#endif
    return out;
  }
  (void)dtype;
  const int64_t total = cpu_rows_in_use(counts, rows);
  const Tensor zone = at::repeat_interleave(counts.to(at::kLong)).narrow(0, 0, total);
  out.narrow(0, 0, total).copy_(y.narrow(0, 0, total).to(at::kFloat) + bias.to(at::kFloat).index_select(0, zone));
  return out;
}

Tensor zone_bias_bwd(const Tensor& grad, const Tensor& counts) {
  const char* op = "zone_bias_bwd";
  const DType dtype = row_dtype(op, "grad", grad);
  check_rows(op, "grad", grad);
  check_counts(op, counts, grad);
  const c10::DeviceGuard guard(grad.device());
  const int64_t zones_n = counts.size(0);
  Tensor out = at::empty({zones_n, grad.size(1)}, grad.options());
  if (grad.is_cuda()) {
#if TE_EP_WITH_CUDA
    const Tensor g = grad.contiguous();
    C10_CUDA_CHECK(zones::bias_bwd_cuda(g.data_ptr(), dtype, g.size(0), g.size(1), counts.data_ptr<int32_t>(),
                                        zones_n, out.data_ptr(), stream_of(g)));
#endif
    return out;
  }
  (void)dtype;
  const int64_t total = cpu_rows_in_use(counts, grad.size(0));
  const Tensor zone = at::repeat_interleave(counts.to(at::kLong)).narrow(0, 0, total);
  Tensor sums = at::zeros({zones_n, grad.size(1)}, grad.options().dtype(at::kFloat));
  sums.index_add_(0, zone, grad.narrow(0, 0, total).to(at::kFloat));
  out.copy_(sums);
  return out;
}

void add_into(const char* op, const Tensor& a, const Tensor& b, const Tensor& counts, const Tensor& out) {
  const DType dtype = row_dtype(op, "a", a);
  check_rows(op, "a", a);
  check_rows(op, "b", b, a.size(0), a.size(1));
  check_same(op, "b", b, a, "a");
  check_counts(op, counts, a);
  const c10::DeviceGuard guard(a.device());
  const int64_t rows = a.size(0);
  if (a.is_cuda()) {
#if TE_EP_WITH_CUDA
    const Tensor x = a.contiguous();
    const Tensor y = b.contiguous();
    C10_CUDA_CHECK(zones::add_cuda(x.data_ptr(), y.data_ptr(), dtype, rows, a.size(1), counts.data_ptr<int32_t>(),
                                   counts.size(0), out.data_ptr(), stream_of(x)));
#endif
    return;
  }
  (void)dtype;
  const int64_t total = cpu_rows_in_use(counts, rows);
  out.narrow(0, 0, total).copy_(a.narrow(0, 0, total) + b.narrow(0, 0, total));
}

Tensor zone_add(const Tensor& a, const Tensor& b, const Tensor& counts) {
  Tensor out = at::empty(a.sizes(), a.options());
  add_into("zone_add", a, b, counts, out);
  return out;
}

// `out` of an _into op: rows like `like`'s, same dtype and device, contiguous.
void check_out(const char* op, const Tensor& out, const Tensor& like, const char* like_name) {
  check_rows(op, like_name, like);
  check_rows(op, "out", out, like.size(0), like.size(1));
  check_same(op, "out", out, like, like_name);
  TORCH_CHECK(out.is_contiguous(), "te_ep.", op, ": out must be contiguous");
}

void zone_add_into(const Tensor& a, const Tensor& b, const Tensor& counts, const Tensor& out) {
  check_out("zone_add_into", out, a, "a");
  add_into("zone_add_into", a, b, counts, out);
}

void scale_into(const char* op, const Tensor& y, const Tensor& weights, const Tensor& counts, const Tensor& out) {
  const DType dtype = row_dtype(op, "y", y);
  check_rows(op, "y", y);
  check_weights(op, weights, y);
  check_counts(op, counts, y);
  const c10::DeviceGuard guard(y.device());
  const int64_t rows = y.size(0);
  if (y.is_cuda()) {
#if TE_EP_WITH_CUDA
    const Tensor x = y.contiguous();
    const Tensor w = weights.contiguous();
    C10_CUDA_CHECK(zones::scale_cuda(x.data_ptr(), w.data_ptr<float>(), dtype, rows, y.size(1),
                                     counts.data_ptr<int32_t>(), counts.size(0), out.data_ptr(), stream_of(x)));
#endif
    return;
  }
  (void)dtype;
  const int64_t total = cpu_rows_in_use(counts, rows);
  out.narrow(0, 0, total).copy_(y.narrow(0, 0, total).to(at::kFloat) * weights.narrow(0, 0, total).unsqueeze(1));
}

Tensor zone_scale(const Tensor& y, const Tensor& weights, const Tensor& counts) {
  Tensor out = at::empty(y.sizes(), y.options());
  scale_into("zone_scale", y, weights, counts, out);
  return out;
}

void zone_scale_into(const Tensor& y, const Tensor& weights, const Tensor& counts, const Tensor& out) {
  check_out("zone_scale_into", out, y, "y");
  scale_into("zone_scale_into", y, weights, counts, out);
}

std::tuple<Tensor, Tensor> zone_scale_bwd(const Tensor& grad, const Tensor& y, const Tensor& weights,
                                          const Tensor& counts) {
  const char* op = "zone_scale_bwd";
  const DType dtype = row_dtype(op, "y", y);
  check_rows(op, "y", y);
  check_rows(op, "grad", grad, y.size(0), y.size(1));
  check_same(op, "grad", grad, y, "y");
  check_weights(op, weights, y);
  check_counts(op, counts, y);
  const c10::DeviceGuard guard(y.device());
  const int64_t rows = y.size(0);
  Tensor grad_y = at::empty(y.sizes(), y.options());
  if (y.is_cuda()) {
#if TE_EP_WITH_CUDA
    Tensor grad_w = at::empty({rows}, weights.options());
    const Tensor g = grad.contiguous();
    const Tensor x = y.contiguous();
    const Tensor w = weights.contiguous();
    C10_CUDA_CHECK(zones::scale_bwd_cuda(g.data_ptr(), x.data_ptr(), w.data_ptr<float>(), dtype, rows, y.size(1),
                                         counts.data_ptr<int32_t>(), counts.size(0), grad_y.data_ptr(),
                                         grad_w.data_ptr<float>(), stream_of(x)));
    return {grad_y, grad_w};
#endif
  }
  (void)dtype;
  const int64_t total = cpu_rows_in_use(counts, rows);
  Tensor grad_w = at::zeros({rows}, weights.options());
  const Tensor g = grad.narrow(0, 0, total).to(at::kFloat);
  grad_y.narrow(0, 0, total).copy_(g * weights.narrow(0, 0, total).unsqueeze(1));
  grad_w.narrow(0, 0, total).copy_((g * y.narrow(0, 0, total).to(at::kFloat)).sum(1));
  return {grad_y, grad_w};
}

}  // namespace

static void register_zone_ops(torch::Library& m) {
  m.impl("zone_glu", &zone_glu);
  m.impl("zone_glu_bwd", &zone_glu_bwd);
  m.impl("zone_bias", &zone_bias);
  m.impl("zone_bias_bwd", &zone_bias_bwd);
  m.impl("zone_add", &zone_add);
  m.impl("zone_add_into", &zone_add_into);
  m.impl("zone_scale", &zone_scale);
  m.impl("zone_scale_into", &zone_scale_into);
  m.impl("zone_scale_bwd", &zone_scale_bwd);
}

TORCH_LIBRARY_IMPL(te_ep, CPU, m) { register_zone_ops(m); }

#if TE_EP_WITH_CUDA
TORCH_LIBRARY_IMPL(te_ep, CUDA, m) { register_zone_ops(m); }
#endif

}  // namespace te_ep
