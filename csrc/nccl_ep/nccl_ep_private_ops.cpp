// Registrations of the private nccl_ep ops (te_ep_torch._nccl_ep calls them),
// and the stand-ins of the nccl_ep backend in builds without NCCL EP, whose
// errors say how to get it.
#include <torch/library.h>

#include <string>

#include "comm/backend.h"

namespace te_ep {

#if !(TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP)

namespace {

constexpr const char* kNotBuilt =
    "te_ep_torch was built without NCCL EP support, so backend 'nccl_ep' is unavailable. Install NCCL EP "
    "(python3 -m te_ep_torch prints the command for the torch installed) on a machine with the CUDA toolkit, "
    "then rebuild from the source tree: `pip install --no-build-isolation --no-deps -e .` (setup.py looks for "
    "nccl_ep.h in the nccl-extensions package or in $TE_EP_NCCL_EP_INCLUDE). Or use backend='reference'.";

}  // namespace

std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg) {
  (void)cfg;
  TORCH_CHECK(false, kNotBuilt);
}

std::string load_nccl_ep(const std::string& nccl_ep_lib, const std::string& nccl_lib) {
  (void)nccl_ep_lib;
  (void)nccl_lib;
  TORCH_CHECK(false, kNotBuilt);
}

bool nccl_ep_built() { return false; }

void nccl_ep_mark_exiting() {}

void release_nccl_ep_group(const std::string& group_name) { (void)group_name; }

#endif  // !(TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP)

TORCH_LIBRARY_IMPL(te_ep, CompositeExplicitAutograd, m) {
  m.impl("_nccl_ep_load", &load_nccl_ep);
  m.impl("_nccl_ep_built", &nccl_ep_built);
  m.impl("_nccl_ep_at_exit", &nccl_ep_mark_exiting);
  m.impl("_nccl_ep_release_group", [](c10::string_view group_name) {
    release_nccl_ep_group(std::string(group_name.data(), group_name.size()));
  });
  m.impl("_nccl_ep_expert_multiple", []() { return kNcclEpExpertMultiple; });
  m.impl("_nccl_ep_capacity_floor", [](int64_t max_tokens_per_rank) {
    TORCH_CHECK(max_tokens_per_rank > 0, "te_ep._nccl_ep_capacity_floor: max_tokens_per_rank must be positive, got ",
                max_tokens_per_rank);
    return nccl_ep_capacity_floor(max_tokens_per_rank);
  });
}

}  // namespace te_ep
