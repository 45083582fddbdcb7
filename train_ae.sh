#!/usr/bin/env bash
# Launch training: ./train_ae.sh [--key=value ...]   (./train_ae.sh --help lists the flags)
# First use creates .venv/ and installs the project into it; later runs reuse it (reinstalling
# only when pyproject.toml changes). `--install-only` stops after that step.
set -euo pipefail
# Paths the user gives (--output_dir=runs/x, --model=mymod:Cls, shard specs, --config) are
# relative to where the command was run: install from the checkout, then run from there.
caller="$PWD"
cd "$(dirname "$0")"
checkout="$PWD"

VENV=.venv
PY="${AE_PYTHON:-python3}"
STAMP="$VENV/.ae-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "ae: installing into $VENV (first run or pyproject.toml changed)..." >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # Without a GPU, pin the CPU build: an unpinned torch drags in GBs of CUDA wheels.
    # Elsewhere set AE_TORCH_SPEC / PIP_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu).
    if command -v nvidia-smi >/dev/null 2>&1; then spec="${AE_TORCH_SPEC:-torch}"
    else spec="${AE_TORCH_SPEC:-torch==2.13.0}"; fi
    "${pip[@]}" "$spec"
  fi
  "${pip[@]}" -e ".[dev]"
  echo "$want" > "$STAMP"
fi

if [ "${1:-}" = "--install-only" ]; then exit 0; fi
cd "$caller"
exec "$checkout/$VENV/bin/python" -m ae.cli.launch "$@"
