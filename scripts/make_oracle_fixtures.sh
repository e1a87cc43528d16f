#!/usr/bin/env bash
# Rebuild the HF-transformers oracle fixtures in tests/fixtures/oracle/ (see scripts/make_oracle_fixtures.py).
# Uses its own venv, .venv-oracle (git-ignored, Python 3.11, CPU torch), separate from the qmtp/JAX venv.
# Usage: bash scripts/make_oracle_fixtures.sh [--only qwen3_5|qwen3_next]
# Env: PYTHON=/path/to/python3.11 to choose the interpreter used to create the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-oracle
TORCH_PIN="torch==2.13.0"
PINS=("transformers==5.24.0" "safetensors==0.8.0" "numpy==2.4.6")

say() { echo "[make_oracle_fixtures] $*"; }
is_311() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; }

find_python311() {
  local cand v p
  for cand in "${PYTHON:-}" python3.11; do
    if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && is_311 "$cand"; then command -v "$cand"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.11(\.[0-9]+)?$' | sort -V -r); do
      p="$(pyenv root)/versions/$v/bin/python3"
      if is_311 "$p"; then echo "$p"; return 0; fi
    done
  fi
  if command -v python3 >/dev/null 2>&1 && is_311 python3; then command -v python3; return 0; fi
  echo "error: the oracle needs Python 3.11 (torch 2.13.0 CPU wheel); none found. Install it or set PYTHON=" >&2
  return 1
}

if [ -x "$VENV/bin/python" ] && is_311 "$VENV/bin/python"; then
  say "using existing $VENV ($("$VENV/bin/python" --version))"
else
  if [ -e "$VENV" ]; then
    say "$VENV exists but is not a Python 3.11 venv; recreating it"
    rm -rf "$VENV"
  fi
  PY="$(find_python311)"
  say "creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi

# torch first and pinned, so that transformers cannot pull in a different torch
say "pip install $TORCH_PIN"
"$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
say "pip install ${PINS[*]} $TORCH_PIN"
"$VENV/bin/python" -m pip install --quiet "${PINS[@]}" "$TORCH_PIN"
"$VENV/bin/python" -c 'import torch, transformers, safetensors, numpy; print("[make_oracle_fixtures] versions: torch", torch.__version__, "| transformers", transformers.__version__, "| safetensors", safetensors.__version__, "| numpy", numpy.__version__)'

say "running scripts/make_oracle_fixtures.py $* (HF_HUB_OFFLINE=1, CPU only)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=0 CUDA_VISIBLE_DEVICES="" \
  "$VENV/bin/python" scripts/make_oracle_fixtures.py "$@"
say "fixtures:"
ls -l tests/fixtures/oracle/*/
