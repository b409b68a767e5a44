#!/usr/bin/env bash
# Runs the MoE example on every local GPU (NCCL), or on 2 CPU processes (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -lt 1 ]; then n=2; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$n" examples/moe_train.py "$@"
