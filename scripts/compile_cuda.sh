#!/usr/bin/env bash
# CI compile check of the CUDA ops (csrc/*.cu) on a machine without a GPU or a CUDA toolkit:
# installs the CUDA 13 compiler from PyPI into its own venv (NVCC_VENV, default .venv-nvcc,
# reused when present) and compiles every csrc/*.cu for sm_80 and sm_90 (nvcc -c: compile
# only, nothing runs), warnings as errors. Then, where .venv has torch, a syntax-only check
# of csrc/bindings.cpp against its headers (a CPU torch lacks one generated c10/cuda header,
# stubbed here; the real build is setup.py's, with a CUDA torch). Exits nonzero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NVCC_VENV:-.venv-nvcc}
PY=${PYTHON:-python3}
PKGS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
secs() { local ms=$((($(date +%s%N) - $1) / 1000000)); printf '%d.%ds' $((ms / 1000)) $((ms % 1000 / 100)); }
t0=$(date +%s%N)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -m pip install -q "${PKGS[@]}" >"$tmp/pip.log" 2>&1; then
    cat "$tmp/pip.log" >&2
    echo "compile_cuda.sh: pip install of the CUDA compiler failed" >&2
    exit 1
fi
# The wheels put the toolkit under site-packages/nvidia/cu13: bin/nvcc (its nvcc.profile
# finds nvvm/bin/cicc and nvvm/libdevice), include/ (cuda_runtime.h, crt/) and
# include/cccl (cub/, cuda/std, thrust/), which nvcc.profile would look for under targets/.
CUDA=$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
NVCC=$CUDA/bin/nvcc
for f in "$NVCC" "$CUDA/nvvm/bin/cicc" "$CUDA/include/cuda_runtime.h" "$CUDA/include/cccl/cub/cub.cuh"; do
    [ -e "$f" ] || { echo "compile_cuda.sh: $f missing from the CUDA wheels" >&2; exit 1; }
done
echo "compile_cuda.sh: $("$NVCC" --version | grep -o "release [^,]*, V[0-9.]*") ($VENV), pip $(secs "$t0")"

export PATH="$CUDA/bin:$CUDA/nvvm/bin:$PATH"
FLAGS=(-c -std=c++17 -O3 -I"$CUDA/include" -isystem "$CUDA/include/cccl"
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
       -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror)
fail=0
for src in csrc/*.cu; do
    s=$(date +%s%N)
    if "$NVCC" "${FLAGS[@]}" "$src" -o "$tmp/$(basename "$src").o" >"$tmp/log" 2>&1; then
        printf '  ok    %-28s sm_80 sm_90  %s\n' "$src" "$(secs "$s")"
    else
        printf '  FAIL  %s\n' "$src"
        sed 's/^/        /' "$tmp/log"
        fail=1
    fi
done

# csrc/bindings.cpp: syntax and warnings against .venv's torch headers, if it has torch.
TORCH_INC=$(.venv/bin/python -c 'import os, torch.utils.cpp_extension as e; print(os.pathsep.join(e.include_paths()))' 2>/dev/null || true)
if [ -n "$TORCH_INC" ] && [ -f csrc/bindings.cpp ]; then
    mkdir -p "$tmp/stub/c10/cuda/impl"
    # generated at a CUDA torch's build time: the one c10/cuda header a CPU wheel lacks
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
    INC=(-isystem "$tmp/stub")
    IFS=: read -ra dirs <<<"$TORCH_INC"
    for d in "${dirs[@]}"; do INC+=(-isystem "$d"); done
    INC+=(-isystem "$CUDA/include" -isystem "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
    s=$(date +%s%N)
    if g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror "${INC[@]}" csrc/bindings.cpp >"$tmp/log" 2>&1; then
        printf '  ok    %-28s syntax only  %s\n' csrc/bindings.cpp "$(secs "$s")"
    else
        printf '  FAIL  csrc/bindings.cpp (syntax)\n'
        sed 's/^/        /' "$tmp/log"
        fail=1
    fi
else
    echo "  skip  csrc/bindings.cpp (no torch in .venv)"
fi
echo "compile_cuda.sh: $([ $fail = 0 ] && echo ok || echo FAILED) in $(secs "$t0")"
exit $fail
