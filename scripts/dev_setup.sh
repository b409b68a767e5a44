#!/usr/bin/env bash
# Sets up a fresh machine for te_ep_torch: installs what is missing (torch
# from PyPI included) and builds the extension against that torch.
#   TORCH_SPEC   pip requirement used when torch is missing (default torch==2.11.0)
#   TE_EP_FORCE_CUDA=0|1  skip / force compiling the CUDA sources
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.11.0}"
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

# Hugging Face transformers for tests/test_transformers.py (te_ep_torch.integrations.transformers).
# --no-deps: its torch extra must not replace the torch installed above. Its own requirements
# follow: the Hugging Face ones at the versions tested, the common ones at transformers' floors.
if ! "$PY" -c "import transformers.integrations.moe" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps transformers==5.17.0
  "$PY" -m pip install --quiet huggingface-hub==1.33.0 tokenizers==0.23.3 safetensors==0.8.0 typer==0.29.2 \
    'regex>=2025.10.22' 'pyyaml>=5.1' 'tqdm>=4.60' 'packaging>=20.0'
fi

# No build isolation: the extension must link against the torch installed above.
"$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
"$PY" -c "import te_ep_torch, torch; print('te_ep_torch', te_ep_torch.__version__, 'on torch', torch.__version__)"
