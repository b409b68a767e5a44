// Placeholder until the NCCL EP backend lands: selecting it fails clearly.
#include "torch/backend.h"

namespace te_ep {

std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig&) {
  TORCH_CHECK(
      false,
      "te_ep: the 'nccl_ep' backend is not available in this build; use backend='reference' (or 'auto')");
}

}  // namespace te_ep
