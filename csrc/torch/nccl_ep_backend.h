// NCCL EP backend entry points beyond make_nccl_ep_backend (backend.h).
#pragma once

#include <string>

namespace te_ep {

// Drops the NCCL EP groups and the NCCL communicator that the nccl_ep backend
// created for the torch process group `group_name`. Groups that no handle uses
// are destroyed now; a group still used by a live handle is destroyed when
// its last handle is, and the communicator after its last group. Collective
// (ncclEpGroupDestroy and ncclCommDestroy are): call it on every rank of the
// group, from the group shutdown path, before the process group itself is
// destroyed. A no-op for groups the backend never saw, and in builds without
// NCCL EP.
void release_nccl_ep_group(const std::string& group_name);

}  // namespace te_ep
