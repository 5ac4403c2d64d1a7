# Sourced by scripts/demo and scripts/test: make .venv and install what the project needs.
# Torch is pinned to the CPU build this machine keeps on disk; a bare "torch" would pull CUDA.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-dev}"
stamp="$VENV/.registry-installed-$EXTRAS"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_bootstrap.sh" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $VENV (torch==2.13.0, registry[$EXTRAS]) ..." >&2
  log="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install -q --upgrade pip &&
         "$VENV/bin/python" -m pip install -q "torch==2.13.0" &&
         "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install failed; full log in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
