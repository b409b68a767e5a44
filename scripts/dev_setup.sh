#!/usr/bin/env bash
# Sets up a fresh machine for te_ep_torch: installs what is missing (torch from PyPI
# included) and builds the extension in place against that torch. On a machine with an
# NVIDIA GPU it also installs NCCL EP and builds the nccl_ep backend (the fast path).
#   TORCH_SPEC   pip requirement used when torch is missing (default: torch==2.11.0 without a
#                GPU; with one, a torch that pins NCCL 2.30.7, the NCCL that NCCL EP needs)
#   TRANSFORMERS_VERSION          the transformers release to install (default 5.24.0, the newest
#                                 the extra takes; CI also runs 5.17.0, its oldest)
#   TE_EP_FORCE_CUDA=0|1          skip / force compiling the CUDA sources
#   TE_EP_NCCL_EP_HEADERS=1       without a GPU too, where the CUDA sources get compiled: install
#                                 NCCL EP's headers (nccl-extensions --no-deps) and require the
#                                 nccl_ep backend to compile (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu=1
elif "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  gpu=1
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  if ((gpu)); then
    # torch 2.14 and 2.15 pin nvidia-nccl-cu13==2.30.7: NCCL EP's NCCL, no override needed.
    # .ci/run passes the same spec to test what this picks: change both together.
    "$PY" -m pip install --quiet "${TORCH_SPEC:-torch>=2.14,<2.16}"
  else
    "$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.11.0}"
  fi
fi
missing=()
for mod in pytest numpy expecttest ninja setuptools wheel; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if ((${#missing[@]})); then
  "$PY" -m pip install --quiet "${missing[@]}"
fi

# TorchTitan for tests/test_torchtitan.py (te_ep_torch.integrations.torchtitan). --no-deps:
# its own requirements would pull another torch and its training stack (datasets, wandb,
# ...); the MoE layer, its sharding and its config system need only these pinned packages.
if ! "$PY" -c "import torchtitan.models.common.token_dispatcher" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
    typeguard==4.6.0 docstring_parser==0.18.0
fi

# TorchTitan's Trainer and model configs for tests/test_torchtitan_trainer.py (TeEpTrainer,
# --module te_ep_torch.integrations.torchtitan): its training stack, which they import. They need
# torch >= 2.12 (TorchTitan's FSDP), so on torch 2.11 those tests skip with the reason.
if ! "$PY" -c "import torchdata, tensorboard, datasets, torch_checkpointing, einops" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps torchdata==0.11.0 torch_checkpointing==0.1.1 einops==0.8.2 \
    tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
    xxhash==4.1.0 pandas==3.1.1 pyarrow==26.0.1 python-dateutil==2.9.0.post0 six==1.17.0 tzdata==2025.2 \
    requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset_normalizer==3.5.3
fi

# Hugging Face transformers for tests/test_transformers.py (te_ep_torch.integrations.transformers):
# one release, exactly; the extra takes 5.17 to 5.24 (docs/transformers.md), and 5.24.0 is the
# newest, which any torch from 2.11 on allows (it asks torch>=2.6). --no-deps: its torch extra must
# not replace the torch installed above. Its own requirements follow: the Hugging Face ones at the
# versions tested (5.17.0 and 5.24.0 both take them), the common ones at transformers' floors.
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
if ! "$PY" -c "import sys, transformers.integrations.moe, transformers as t; sys.exit(t.__version__ != '$TRANSFORMERS_VERSION')" \
    2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps "transformers==$TRANSFORMERS_VERSION"
  "$PY" -m pip install --quiet huggingface-hub==1.33.0 tokenizers==0.23.3 safetensors==0.8.0 typer==0.29.2 \
    'regex>=2025.10.22' 'pyyaml>=5.1' 'tqdm>=4.60' 'packaging>=20.0'
fi

# NCCL EP before the build: setup.py compiles the nccl_ep backend against its headers.
if ((gpu)) && [ "${TE_EP_FORCE_CUDA:-}" != 0 ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 14) else 1)"; then
    # Its cu13 extra pins the NCCL this torch pins too: no second torch, no override.
    "$PY" -m pip install --quiet 'nccl-extensions[cu13]'
  else
    echo "dev_setup: torch $("$PY" -c 'import torch; print(torch.__version__)') pins an NCCL older than NCCL EP needs;" \
         "replacing it with nvidia-nccl-cu13==2.30.7 (pip warns about torch's pin; NCCL is backward compatible)."
    "$PY" -m pip install --quiet nccl-extensions 'nvidia-nccl-cu13==2.30.7'
  fi
  export TE_EP_REQUIRE_NCCL_EP_BUILD=1
elif [ "${TE_EP_NCCL_EP_HEADERS:-}" = 1 ] && [ "${TE_EP_FORCE_CUDA:-}" != 0 ] &&
     "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" &&
     { command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; }; then
  # Headers only (nccl.h comes with torch's nvidia-nccl-cu13): compiles the fast path.
  "$PY" -c "import importlib.metadata as m; m.distribution('nccl-extensions')" 2>/dev/null ||
    "$PY" -m pip install --quiet --no-deps nccl-extensions
  export TE_EP_REQUIRE_NCCL_EP_BUILD=1
fi

# No build isolation: the extension must link against the torch installed above.
"$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
"$PY" -m te_ep_torch
