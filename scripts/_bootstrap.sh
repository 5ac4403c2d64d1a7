# Sourced by scripts/demo and scripts/test: make .venv and install what the project needs.
# Torch goes in first, as the CPU build: PyPI's Linux wheel of a bare "torch" pulls CUDA (about 5 GB). A wheelhouse
# or index that pip is configured with may carry the CPU build (torch==2.13.0+cpu); otherwise PyTorch's CPU index
# serves it. Already there, it is not asked for again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-dev}"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
stamp="$VENV/.registry-installed-$EXTRAS"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_bootstrap.sh" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
install_torch() {
  if "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
       2>/dev/null; then
    return 0
  fi
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION+cpu" ||
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $VENV (torch==$TORCH_VERSION CPU build, registry[$EXTRAS]) ..." >&2
  log="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install -q --upgrade pip &&
         install_torch &&
         "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install failed; full log in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
