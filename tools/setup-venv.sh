#!/usr/bin/env bash
# Create (or reuse) .venv on Python 3.12 with exactly requirements.lock, plus mcorekit in editable mode.
# Megatron-Core >= 0.17 needs Python 3.12. uv installs from its cache by hardlink, so a second checkout
# on the same machine (CI's fresh clone) gets the 5 GB environment in seconds rather than minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp="$venv/.mcorekit-lock"
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c 'import mcorekit' 2>/dev/null; then
  exit 0
fi

find_python312() {
  local cand
  for cand in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand" || echo "$cand"; return 0
    fi
  done
  return 1
}
py=$(find_python312) || {
  echo "setup-venv: no Python 3.12 found (Megatron-Core >= 0.17 needs it). Install python3.12 or set PYTHON312=/path/to/python3.12" >&2
  exit 1
}
echo "setup-venv: building $venv with $py ($("$py" --version))"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check uv==0.13.9
"$venv/bin/uv" pip sync -q --python "$venv/bin/python" requirements.lock
"$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps -e .
"$venv/bin/python" -c 'import torch, megatron.core, transformers, submitit, mcorekit; print("setup-venv: ready: torch", torch.__version__, "megatron-core", megatron.core.__version__, "transformers", transformers.__version__)'
echo "$want" > "$stamp"
