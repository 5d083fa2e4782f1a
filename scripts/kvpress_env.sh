#!/usr/bin/env bash
# Creates a separate virtualenv with NVIDIA's kvpress, for scripts/kvpress_kept_sets.py (kvpress vs our KVzip).
#
# kvpress pins transformers < 5.3 while proxykv_hf needs 5.23, so it can never share our venv and is no
# dependency of the project. How to run me (CPU; a few minutes the first time, seconds after):
#
#     bash scripts/kvpress_env.sh                 # -> .venv-kvpress/ in the repo root (git-ignored)
#     bash scripts/kvpress_env.sh /tmp/kvp-venv   # or anywhere else
#     PYTHON=python3.11 bash scripts/kvpress_env.sh
#
# Idempotent: an existing venv whose versions already match is left as it is. Set FORCE=1 to reinstall.
# Versions (override through the environment):
#   TORCH_SPEC        torch==2.13.0   (CPU: the +cpu wheel where pip's find-links has one; a check below fails on
#                                      a CUDA build unless ALLOW_CUDA=1)
#   KVPRESS_VERSION   0.5.5           (newest on PyPI; has presses/kvzip_press.py with the global `layerwise=False`)
#   TRANSFORMERS_SPEC transformers==5.2.0  (newest release kvpress 0.5.5 allows: it requires >=4.56,<5.3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-kvpress}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
KVPRESS_VERSION="${KVPRESS_VERSION:-0.5.5}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-transformers==5.2.0}"

want_torch="${TORCH_SPEC#torch==}"
want_tf="${TRANSFORMERS_SPEC#transformers==}"

versions() {  # prints "torch transformers kvpress cuda" of the venv, or fails
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
import torch
print(md.version("torch").split("+")[0], md.version("transformers"), md.version("kvpress"), torch.version.cuda)
EOF
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

current="$(versions || true)"
if [ "${FORCE:-0}" != "1" ] && [ "$current" = "$want_torch $want_tf $KVPRESS_VERSION None" ]; then
    echo "$VENV is up to date"
else
    echo "installing into $VENV (found: ${current:-nothing})"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and alone, so that kvpress's "torch>=2.3.1,<3" cannot pull a CUDA build with its nvidia-* wheels.
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q "kvpress==$KVPRESS_VERSION" "$TRANSFORMERS_SPEC" "$TORCH_SPEC" safetensors
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import os
import sys

import torch

names = ["kvpress", "transformers", "torch", "accelerate", "tokenizers", "safetensors", "numpy", "peft", "datasets"]
print(f"python {sys.version.split()[0]}  ({sys.executable})")
for name in names:
    print(f"{name:13s} {md.version(name)}")
print(f"torch CUDA build: {torch.version.cuda}")
from kvpress import KVzipPress  # noqa: E402  (also applies kvpress's attention patch: a smoke test of the import)

print("kvpress.KVzipPress imports")
if torch.version.cuda is not None and os.environ.get("ALLOW_CUDA") != "1":
    sys.exit("a CUDA build of torch was installed; set TORCH_SPEC to a +cpu wheel (or ALLOW_CUDA=1 to accept it)")
EOF
