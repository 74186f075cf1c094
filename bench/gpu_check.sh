#!/usr/bin/env bash
# GPU check, prepared (no downloads; the model is built from a config with random weights):
# vLLM generation with an interruption and a reload whose log-probs are checked against the new
# weights, an FSDP2 step and a DeepSpeed step, tokens/s for each (bench/gpu_check.py).
#   bench/gpu_check.sh             one GPU, under 8 minutes on an H200
#   bench/gpu_check.sh --dry-run   the same plumbing on the CPU (tiny model, few tokens)
# A part whose engine or extra is missing prints SKIP with the reason; exit 1 if one FAILed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  . .venv/bin/activate
fi
exec timeout 470 python bench/gpu_check.py "$@"
