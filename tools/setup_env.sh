#!/usr/bin/env bash
# Create (once) the Python >= 3.12 environment the package needs and install it into it.
# Prints the environment's python path on its last line. Idempotent: re-running after the
# requirements change reinstalls only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MDKV_VENV:-$HOME/.cache/mdkv/venv}"

find_python() {
  for c in python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V -r); do
      p="$(pyenv root)/versions/$v/bin/python"
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  if python3 -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then command -v python3; return 0; fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)" || { echo "error: megatron-core 0.19 needs Python >= 3.12 and none was found (install one, or set MDKV_VENV to an existing venv)" >&2; exit 1; }
  echo "creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
fi
STAMP="$VENV/.mdkv-requirements"
if ! cmp -s requirements.txt "$STAMP"; then
  echo "installing requirements into $VENV (torch is a large download the first time)" >&2
  "$VENV/bin/python" -m pip install -q -r requirements.txt >&2
  cp requirements.txt "$STAMP"
fi
# Editable install of this checkout; the CUDA extension builds only where a GPU is visible.
HERE="$(pwd -P)"
if ! (cd / && "$VENV/bin/python" -c "import megatron_dualkv, os, sys; sys.exit(0 if os.path.realpath(megatron_dualkv.__path__[0]) == '$HERE/megatron_dualkv' else 1)") 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . >&2
fi
echo "$VENV/bin/python"
