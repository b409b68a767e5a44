#!/usr/bin/env bash
# Trains the example MoE transformer (examples/moe_train.py) with EP x FSDP2 on every
# local GPU (NCCL, nccl_ep where usable), or on 2 CPU processes (gloo, reference
# backend) where there is no GPU. Extra arguments go to moe_train.py, e.g. --check.
#   NPROC   number of processes (default: the GPU count, or 2 without GPUs), e.g.
#           NPROC=4 bash examples/run_moe_train.sh --ep 2   # dp 2 x EP 2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
n=${NPROC:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
if [ "$n" -lt 1 ]; then n=2; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# This checkout's te_ep_torch, even if another copy is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$n" examples/moe_train.py "$@"
