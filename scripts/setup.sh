#!/usr/bin/env bash
# Set up the project's environment in .venv: CPU or CUDA torch, the pinned stack, medpfl.
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # + pytest, hypothesis
# Environment:
#   PYTHON=python3.11        interpreter for the venv (default: python3.11, else python3)
#   TORCH_INDEX_URL=...      where torch comes from, e.g. https://download.pytorch.org/whl/cpu for a
#                            small CPU-only build on a laptop (default: the normal package index)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' \
  || { echo "setup: Python >= 3.11 is required (found $("$py" --version))" >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$py" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    pip install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    pip install -q "torch==2.13.0"
  fi
fi
# requirements.lock pins every transitive dependency to the versions the project was tested with.
pip install -q -c requirements.lock -e ".${extras}"
# medmnist pulls in torchvision, which the project does not use and which breaks the CPU torch
# build's imports (operator torchvision::nms does not exist) and with them transformers/peft.
pip uninstall -q -y torchvision 2>/dev/null || true
python -c 'import medpfl, torch, snakemake, dvc, mlflow, pandera, peft, transformers, rich; print("setup: ok, torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'
