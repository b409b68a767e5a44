// at::Tensor adapters of the permutation ops (schemas in library.cpp,
// contract in docs/permutation.md). Each op validates its arguments here and
// then calls the framework-free CPU kernel (core/permute.h) or CUDA
// launcher (core/permute_kernels.h); one function serves both dispatch
// keys and picks the kernel by device.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "permute/core/permute.h"
#include "common/scalar_type.h"

#if TE_EP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "permute/core/permute_kernels.h"
#endif

namespace te_ep {
namespace {

namespace perm = permutation;

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Row ids, slots and chunk rows are stored as int32.
constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();

perm::DType row_dtype(const char* op, const char* name, const Tensor& t) {
  const std::optional<DType> dtype = dtype_of(t.scalar_type());
  TORCH_CHECK(dtype && is_floating(*dtype), op, ": ", name, " must be bfloat16, float16 or float32, got ",
              t.scalar_type());
  return *dtype;
}

perm::IndexType index_type(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kInt ? perm::IndexType::kInt32 : perm::IndexType::kInt64;
}

void check_dtype(const char* op, const char* name, const Tensor& t, at::ScalarType expected) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, " must be ", expected, ", got ", t.scalar_type());
}

void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got ", t.dim(), "-D (shape ", t.sizes(), ")");
}

void check_contiguous(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (shape ", t.sizes(), ", strides ",
              t.strides(), ")");
}

void check_device(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

void check_size(const char* op, const char* name, const Tensor& t, int64_t dim, int64_t expected,
                const char* expected_what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") must equal ", expected_what, " (",
              expected, "), got ", t.size(dim));
}

// A [rows, H] tensor of bf16/fp16/fp32 rows.
perm::DType check_rows(const char* op, const char* name, const Tensor& t) {
  check_dim(op, name, t, 2);
  check_contiguous(op, name, t);
  TORCH_CHECK(t.size(0) <= kMaxIndex, op, ": ", name, " has ", t.size(0), " rows, more than the supported ",
              kMaxIndex);
  return row_dtype(op, name, t);
}

// An int32 map produced by permute or sort_chunks_by_index.
void check_map(const char* op, const char* name, const Tensor& t, int64_t dim, const char* ref_name,
               const Tensor& ref) {
  check_dim(op, name, t, dim);
  check_dtype(op, name, t, at::kInt);
  check_contiguous(op, name, t);
  check_device(op, name, t, ref_name, ref);
}

// Rows a CPU map may point to, so a map from another call (e.g. a larger
// capacity) raises instead of reading out of bounds. CUDA kernels trust the
// map: checking it there would need a host sync.
void check_map_rows_cpu(const char* op, const char* name, const Tensor& map, int64_t rows, const char* rows_what) {
  if (!map.device().is_cpu() || map.numel() == 0) return;
  const int64_t max_row = map.max().item<int64_t>();
  TORCH_CHECK(max_row < rows, op, ": ", name, " refers to row ", max_row, " but ", rows_what, " has ", rows,
              " rows");
}

// Float32 probabilities with the given shape.
void check_probs(const char* op, const char* name, const Tensor& p, at::IntArrayRef shape, const char* ref_name,
                 const Tensor& ref) {
  check_dtype(op, name, p, at::kFloat);
  TORCH_CHECK(p.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", p.sizes());
  check_contiguous(op, name, p);
  check_device(op, name, p, ref_name, ref);
}

const float* data_or_null(const OptTensor& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

float* data_or_null(Tensor& t, bool present) { return present ? t.data_ptr<float>() : nullptr; }

Tensor empty_probs(const Tensor& like, int64_t n) { return at::empty({n}, like.options().dtype(at::kFloat)); }

#if TE_EP_WITH_CUDA
cudaStream_t stream_of(const Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void check_choices_cuda(const char* op, const Tensor& map_like) {
  TORCH_CHECK(map_like.size(1) <= perm::kMaxChoicesCuda, op, ": CUDA kernels support up to ",
              perm::kMaxChoicesCuda, " choices per token (routing.size(1)), got ", map_like.size(1));
}
#endif

[[noreturn]] void no_cuda(const char* op) {
  TORCH_CHECK(false, op, ": te_ep_torch was built without CUDA; rebuild with CUDA to run on the GPU");
}

// ---- permute ------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> permute(const Tensor& tokens, const Tensor& routing,
                                                                   const OptTensor& probs, int64_t num_experts,
                                                                   int64_t capacity, int64_t alignment) {
  constexpr const char* op = "te_ep.permute";
  const perm::DType dtype = check_rows(op, "tokens", tokens);
  check_dim(op, "routing", routing, 2);
  check_contiguous(op, "routing", routing);
  check_device(op, "routing", routing, "tokens", tokens);
  check_size(op, "routing", routing, 0, tokens.size(0), "tokens.size(0)");
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMaxIndex, op, ": num_experts must be in [1, ", kMaxIndex,
              "], got ", num_experts);
  perm::Routing view;
  view.data = routing.data_ptr();
  view.num_tokens = routing.size(0);
  view.num_choices = routing.size(1);
  if (routing.scalar_type() == at::kBool) {
    view.format = perm::RoutingFormat::kMask;
    check_size(op, "routing", routing, 1, num_experts, "num_experts for a boolean routing map");
  } else {
    TORCH_CHECK(routing.scalar_type() == at::kInt || routing.scalar_type() == at::kLong, op,
                ": routing must be int32 or int64 expert ids [T, K] or a bool routing map [T, E], got ",
                routing.scalar_type());
    view.format = perm::RoutingFormat::kTopK;
    view.index_type = index_type(op, "routing", routing);
  }
  TORCH_CHECK(view.num_tokens * view.num_choices <= kMaxIndex, op, ": routing has ",
              view.num_tokens * view.num_choices, " choices (", routing.sizes(), "), more than the supported ",
              kMaxIndex);
  TORCH_CHECK(capacity >= 0 && capacity <= kMaxIndex, op, ": capacity must be in [0, ", kMaxIndex, "], got ",
              capacity);
  TORCH_CHECK(alignment >= 1 && (alignment & (alignment - 1)) == 0, op,
              ": alignment must be a power of two >= 1, got ", alignment);
  if (probs.has_value()) check_probs(op, "probs", *probs, routing.sizes(), "tokens", tokens);

  const c10::OptionalDeviceGuard guard(tokens.device());
  const auto index_options = tokens.options().dtype(at::kInt);
  Tensor row_id_map = at::empty({view.num_tokens, view.num_choices}, index_options);
  Tensor src_slot = at::empty({capacity}, index_options);
  Tensor expert_counts = at::empty({num_experts}, index_options);
  Tensor required_rows = at::empty({1}, tokens.options().dtype(at::kLong));
  Tensor out = at::empty({capacity, tokens.size(1)}, tokens.options());
  Tensor permuted_probs = empty_probs(tokens, probs.has_value() ? capacity : 0);
  const int64_t hidden = tokens.size(1);

  if (tokens.device().is_cpu()) {
    const perm::MapResult map =
        perm::build_permute_map_cpu(view, num_experts, capacity, alignment, row_id_map.data_ptr<int32_t>(),
                                    src_slot.data_ptr<int32_t>(), expert_counts.data_ptr<int32_t>());
    TORCH_CHECK(map.error.empty(), op, ": ", map.error);
    required_rows.data_ptr<int64_t>()[0] = map.required_rows;
    TORCH_CHECK(map.required_rows <= capacity, op, ": capacity overflow: the routing needs ", map.required_rows,
                " rows (alignment ", alignment, "), capacity is ", capacity);
    perm::permute_rows_cpu(tokens.data_ptr(), dtype, view.num_tokens, hidden, view.num_choices,
                           row_id_map.data_ptr<int32_t>(), nullptr, data_or_null(probs), capacity,
                           src_slot.data_ptr<int32_t>(), out.data_ptr(),
                           data_or_null(permuted_probs, probs.has_value()));
    return {out, permuted_probs, row_id_map, src_slot, expert_counts, required_rows};
  }
#if TE_EP_WITH_CUDA
  check_choices_cuda(op, routing);
  const cudaStream_t stream = stream_of(tokens);
  Tensor workspace = at::empty(
      {static_cast<int64_t>(perm::permute_map_workspace_bytes(view, num_experts))},
      tokens.options().dtype(at::kByte));
  C10_CUDA_CHECK(perm::build_permute_map_cuda(view, num_experts, capacity, alignment, row_id_map.data_ptr<int32_t>(),
                                              src_slot.data_ptr<int32_t>(), expert_counts.data_ptr<int32_t>(),
                                              required_rows.data_ptr<int64_t>(), workspace.data_ptr(), stream));
  C10_CUDA_CHECK(perm::permute_rows_cuda(tokens.data_ptr(), dtype, view.num_tokens, hidden, view.num_choices,
                                         row_id_map.data_ptr<int32_t>(), nullptr, data_or_null(probs), capacity,
                                         src_slot.data_ptr<int32_t>(), out.data_ptr(),
                                         data_or_null(permuted_probs, probs.has_value()), stream));
  return {out, permuted_probs, row_id_map, src_slot, expert_counts, required_rows};
#else
  no_cuda(op);
#endif
}

// Either gradient may be absent (autograd passes only those of outputs that
// were used); the matching result is then an empty [0] tensor. row_id_map
// comes first because DTensor takes the mesh from the first argument.
std::tuple<Tensor, Tensor> permute_bwd(const Tensor& row_id_map, const OptTensor& grad_output,
                                       const OptTensor& grad_permuted_probs) {
  constexpr const char* op = "te_ep.permute_bwd";
  check_dim(op, "row_id_map", row_id_map, 2);
  check_dtype(op, "row_id_map", row_id_map, at::kInt);
  check_contiguous(op, "row_id_map", row_id_map);
  TORCH_CHECK(grad_output.has_value() || grad_permuted_probs.has_value(), op,
              ": needs grad_output or grad_permuted_probs, got neither");
  const int64_t capacity = grad_output.has_value() ? grad_output->size(0) : grad_permuted_probs->size(0);
  perm::DType dtype = perm::DType::kFloat32;
  if (grad_output.has_value()) {
    dtype = check_rows(op, "grad_output", *grad_output);
    check_device(op, "grad_output", *grad_output, "row_id_map", row_id_map);
  }
  if (grad_permuted_probs.has_value()) {
    check_probs(op, "grad_permuted_probs", *grad_permuted_probs, {capacity}, "row_id_map", row_id_map);
  }
  check_map_rows_cpu(op, "row_id_map", row_id_map, capacity, "the permuted buffer");

  const c10::OptionalDeviceGuard guard(row_id_map.device());
  const int64_t num_tokens = row_id_map.size(0);
  const int64_t num_choices = row_id_map.size(1);
  const int64_t hidden = grad_output.has_value() ? grad_output->size(1) : 0;
  Tensor grad_tokens = grad_output.has_value() ? at::empty({num_tokens, hidden}, grad_output->options())
                                               : empty_probs(row_id_map, 0);
  Tensor grad_probs = grad_permuted_probs.has_value()
                          ? at::empty({num_tokens, num_choices}, row_id_map.options().dtype(at::kFloat))
                          : empty_probs(row_id_map, 0);
  if (row_id_map.device().is_cpu()) {
    if (grad_output.has_value()) {
      perm::unpermute_rows_cpu(grad_output->data_ptr(), dtype, num_tokens, hidden, num_choices,
                               row_id_map.data_ptr<int32_t>(), nullptr, grad_tokens.data_ptr());
    }
    if (grad_permuted_probs.has_value()) {
      perm::gather_values_cpu(row_id_map.data_ptr<int32_t>(), num_tokens * num_choices,
                              grad_permuted_probs->data_ptr<float>(), grad_probs.data_ptr<float>());
    }
    return {grad_tokens, grad_probs};
  }
#if TE_EP_WITH_CUDA
  check_choices_cuda(op, row_id_map);
  const cudaStream_t stream = stream_of(row_id_map);
  if (grad_output.has_value()) {
    C10_CUDA_CHECK(perm::unpermute_rows_cuda(grad_output->data_ptr(), dtype, num_tokens, hidden, num_choices,
                                             row_id_map.data_ptr<int32_t>(), nullptr, grad_tokens.data_ptr(),
                                             stream));
  }
  if (grad_permuted_probs.has_value()) {
    C10_CUDA_CHECK(perm::gather_values_cuda(row_id_map.data_ptr<int32_t>(), num_tokens * num_choices,
                                            grad_permuted_probs->data_ptr<float>(), grad_probs.data_ptr<float>(),
                                            stream));
  }
  return {grad_tokens, grad_probs};
#else
  no_cuda(op);
#endif
}

// ---- unpermute ------------------------------------------------------------------

Tensor unpermute(const Tensor& input, const Tensor& row_id_map, const Tensor& src_slot,
                 const OptTensor& merging_probs) {
  constexpr const char* op = "te_ep.unpermute";
  const perm::DType dtype = check_rows(op, "input", input);
  check_map(op, "row_id_map", row_id_map, 2, "input", input);
  check_map(op, "src_slot", src_slot, 1, "input", input);
  check_size(op, "src_slot", src_slot, 0, input.size(0), "input.size(0)");
  if (merging_probs.has_value()) {
    check_probs(op, "merging_probs", *merging_probs, row_id_map.sizes(), "input", input);
  }
  check_map_rows_cpu(op, "row_id_map", row_id_map, input.size(0), "input");

  const c10::OptionalDeviceGuard guard(input.device());
  const int64_t num_tokens = row_id_map.size(0);
  const int64_t num_choices = row_id_map.size(1);
  const int64_t hidden = input.size(1);
  Tensor out = at::empty({num_tokens, hidden}, input.options());
  if (input.device().is_cpu()) {
    perm::unpermute_rows_cpu(input.data_ptr(), dtype, num_tokens, hidden, num_choices, row_id_map.data_ptr<int32_t>(),
                             data_or_null(merging_probs), out.data_ptr());
    return out;
  }
#if TE_EP_WITH_CUDA
  check_choices_cuda(op, row_id_map);
  C10_CUDA_CHECK(perm::unpermute_rows_cuda(input.data_ptr(), dtype, num_tokens, hidden, num_choices,
                                           row_id_map.data_ptr<int32_t>(), data_or_null(merging_probs),
                                           out.data_ptr(), stream_of(input)));
  return out;
#else
  no_cuda(op);
#endif
}

std::tuple<Tensor, Tensor> unpermute_bwd(const Tensor& grad_output, const Tensor& row_id_map, const Tensor& src_slot,
                                         const OptTensor& merging_probs, const OptTensor& input) {
  constexpr const char* op = "te_ep.unpermute_bwd";
  const perm::DType dtype = check_rows(op, "grad_output", grad_output);
  check_map(op, "row_id_map", row_id_map, 2, "grad_output", grad_output);
  check_size(op, "row_id_map", row_id_map, 0, grad_output.size(0), "grad_output.size(0)");
  check_map(op, "src_slot", src_slot, 1, "grad_output", grad_output);
  const int64_t capacity = src_slot.size(0);
  if (merging_probs.has_value()) {
    check_probs(op, "merging_probs", *merging_probs, row_id_map.sizes(), "grad_output", grad_output);
  }
  if (input.has_value()) {
    TORCH_CHECK(merging_probs.has_value(), op,
                ": input is only needed for the gradient of merging_probs, but merging_probs is None");
    check_rows(op, "input", *input);
    TORCH_CHECK(input->scalar_type() == grad_output.scalar_type(), op, ": input must have the dtype of grad_output (",
                grad_output.scalar_type(), "), got ", input->scalar_type());
    check_device(op, "input", *input, "grad_output", grad_output);
    check_size(op, "input", *input, 0, capacity, "src_slot.size(0)");
    check_size(op, "input", *input, 1, grad_output.size(1), "grad_output.size(1)");
  }
  check_map_rows_cpu(op, "row_id_map", row_id_map, capacity, "src_slot");
  check_map_rows_cpu(op, "src_slot", src_slot, row_id_map.numel(), "row_id_map (as slots)");

  const c10::OptionalDeviceGuard guard(grad_output.device());
  const int64_t num_tokens = row_id_map.size(0);
  const int64_t num_choices = row_id_map.size(1);
  const int64_t hidden = grad_output.size(1);
  Tensor grad_input = at::empty({capacity, hidden}, grad_output.options());
  Tensor grad_probs = input.has_value()
                          ? at::empty({num_tokens, num_choices}, grad_output.options().dtype(at::kFloat))
                          : empty_probs(grad_output, 0);
  if (grad_output.device().is_cpu()) {
    perm::permute_rows_cpu(grad_output.data_ptr(), dtype, num_tokens, hidden, num_choices,
                           row_id_map.data_ptr<int32_t>(), data_or_null(merging_probs), nullptr, capacity,
                           src_slot.data_ptr<int32_t>(), grad_input.data_ptr(), nullptr);
    if (input.has_value()) {
      perm::unpermute_probs_grad_cpu(grad_output.data_ptr(), input->data_ptr(), dtype, num_tokens, hidden,
                                     num_choices, row_id_map.data_ptr<int32_t>(), grad_probs.data_ptr<float>());
    }
    return {grad_input, grad_probs};
  }
#if TE_EP_WITH_CUDA
  check_choices_cuda(op, row_id_map);
  const cudaStream_t stream = stream_of(grad_output);
  C10_CUDA_CHECK(perm::permute_rows_cuda(grad_output.data_ptr(), dtype, num_tokens, hidden, num_choices,
                                         row_id_map.data_ptr<int32_t>(), data_or_null(merging_probs), nullptr,
                                         capacity, src_slot.data_ptr<int32_t>(), grad_input.data_ptr(), nullptr,
                                         stream));
  if (input.has_value()) {
    C10_CUDA_CHECK(perm::unpermute_probs_grad_cuda(grad_output.data_ptr(), input->data_ptr(), dtype, num_tokens,
                                                   hidden, num_choices, row_id_map.data_ptr<int32_t>(),
                                                   grad_probs.data_ptr<float>(), stream));
  }
  return {grad_input, grad_probs};
#else
  no_cuda(op);
#endif
}

// ---- chunk sort -----------------------------------------------------------------

// Gathers rows (and probabilities) of `input` through one half of a
// [2, N] chunk map.
std::tuple<Tensor, Tensor> gather_through_map(const char* op, perm::DType dtype, const Tensor& input,
                                              const Tensor& index, const OptTensor& probs) {
  const int64_t num_rows = input.size(0);
  const int64_t hidden = input.size(1);
  Tensor out = at::empty_like(input);
  Tensor out_probs = empty_probs(input, probs.has_value() ? num_rows : 0);
  if (input.device().is_cpu()) {
    perm::gather_rows_cpu(input.data_ptr(), dtype, num_rows, hidden, index.data_ptr<int32_t>(), data_or_null(probs),
                          out.data_ptr(), data_or_null(out_probs, probs.has_value()));
    return {out, out_probs};
  }
#if TE_EP_WITH_CUDA
  C10_CUDA_CHECK(perm::gather_rows_cuda(input.data_ptr(), dtype, num_rows, hidden, index.data_ptr<int32_t>(),
                                        data_or_null(probs), out.data_ptr(),
                                        data_or_null(out_probs, probs.has_value()), stream_of(input)));
  return {out, out_probs};
#else
  no_cuda(op);
#endif
}

std::tuple<Tensor, Tensor, Tensor> sort_chunks_by_index(const Tensor& input, const Tensor& split_sizes,
                                                        const Tensor& sorted_index, const OptTensor& probs) {
  constexpr const char* op = "te_ep.sort_chunks_by_index";
  const perm::DType dtype = check_rows(op, "input", input);
  check_dim(op, "split_sizes", split_sizes, 1);
  check_contiguous(op, "split_sizes", split_sizes);
  check_device(op, "split_sizes", split_sizes, "input", input);
  const perm::IndexType sizes_type = index_type(op, "split_sizes", split_sizes);
  check_dim(op, "sorted_index", sorted_index, 1);
  check_contiguous(op, "sorted_index", sorted_index);
  check_device(op, "sorted_index", sorted_index, "input", input);
  const perm::IndexType order_type = index_type(op, "sorted_index", sorted_index);
  check_size(op, "sorted_index", sorted_index, 0, split_sizes.size(0), "split_sizes.size(0)");
  const int64_t num_rows = input.size(0);
  if (probs.has_value()) check_probs(op, "probs", *probs, {num_rows}, "input", input);

  const c10::OptionalDeviceGuard guard(input.device());
  const int64_t num_chunks = split_sizes.size(0);
  Tensor row_map = at::empty({2, num_rows}, input.options().dtype(at::kInt));
  if (input.device().is_cpu()) {
    const std::string error =
        perm::build_chunk_map_cpu(split_sizes.data_ptr(), sizes_type, sorted_index.data_ptr(), order_type, num_chunks,
                                  num_rows, row_map.data_ptr<int32_t>());
    TORCH_CHECK(error.empty(), op, ": ", error);
  } else {
#if TE_EP_WITH_CUDA
    Tensor workspace = at::empty({static_cast<int64_t>(perm::chunk_map_workspace_bytes(num_chunks))},
                                 input.options().dtype(at::kByte));
    C10_CUDA_CHECK(perm::build_chunk_map_cuda(split_sizes.data_ptr(), sizes_type, sorted_index.data_ptr(),
                                              order_type, num_chunks, num_rows, row_map.data_ptr<int32_t>(),
                                              workspace.data_ptr(), stream_of(input)));
#else
    no_cuda(op);
#endif
  }
  auto [out, out_probs] = gather_through_map(op, dtype, input, row_map[0], probs);
  return {out, out_probs, row_map};
}

std::tuple<Tensor, Tensor> sort_chunks_by_map(const Tensor& input, const Tensor& row_map, const OptTensor& probs,
                                              bool inverse) {
  constexpr const char* op = "te_ep.sort_chunks_by_map";
  const perm::DType dtype = check_rows(op, "input", input);
  check_map(op, "row_map", row_map, 2, "input", input);
  check_size(op, "row_map", row_map, 0, 2, "2 (forward and inverse halves)");
  check_size(op, "row_map", row_map, 1, input.size(0), "input.size(0)");
  if (probs.has_value()) check_probs(op, "probs", *probs, {input.size(0)}, "input", input);
  check_map_rows_cpu(op, "row_map", row_map, input.size(0), "input");

  const c10::OptionalDeviceGuard guard(input.device());
  return gather_through_map(op, dtype, input, row_map[inverse ? 1 : 0], probs);
}

}  // namespace

// One kernel table for both devices: each op picks its CPU or CUDA kernel
// from the tensors' device.
static void register_permute_ops(torch::Library& m) {
  m.impl("permute", &permute);
  m.impl("permute_bwd", &permute_bwd);
  m.impl("unpermute", &unpermute);
  m.impl("unpermute_bwd", &unpermute_bwd);
  m.impl("sort_chunks_by_index", &sort_chunks_by_index);
  m.impl("sort_chunks_by_map", &sort_chunks_by_map);
}

TORCH_LIBRARY_IMPL(te_ep, CPU, m) { register_permute_ops(m); }

#if TE_EP_WITH_CUDA
TORCH_LIBRARY_IMPL(te_ep, CUDA, m) { register_permute_ops(m); }
#endif

}  // namespace te_ep
