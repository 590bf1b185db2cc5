#!/usr/bin/env bash
# One-shot check of the GPU path on a lent GPU machine (no vLLM, no network there):
#   stage 0  env: the wheels from scripts/gpu_wheels.sh (.whl/, carried) into /tmp/site,
#            nvidia-smi, torch / triton / CUDA, the GPU, vllm_saguaro.config importable
#   stage 1  build the CUDA ops in place (vllm_saguaro._C) for sm_90; available() is True
#   stage 2  the ops on the GPU: Triton kernels compiled (tests/ops/kernel_checks.py), CUDA
#            ops (tests/ops/test_cuda_ops.py), references (tests/ops/test_ops.py)
#   stage 3  the draft worker on the GPU (tests/draft/test_worker_gpu.py)
#   stage 4  each op's implementations timed on the GPU (benchmarks/ops_timing.py)
#   stage 5  the worker's fallback and pre-speculation, GPU vs CPU (optional)
# Results: $OUT/gpu_check.json (rewritten after every stage: a run cut short keeps what
# finished), $OUT/gpu_check.log (everything printed), $OUT/ops_timing_gpu.json,
# $OUT/worker_timing_gpu.json, $OUT/junit_{ops,worker}.xml. Exit 0 iff every required stage
# passed. Writes only under the repository, /tmp and $OUT; safe to rerun.
#   bash scripts/gpu_check.sh          (OUT default /tmp/gpu_check; GPU_CHECK_BUDGET_S 480)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-480}   # seconds for all stages (the caller's limit is ~540)
WORK=/tmp/gpu_check_work
JSON=$OUT/gpu_check.json
FIGS=$WORK/figures.json            # the running stage's key figures (gpu_check_lib.py)
export OUT FIGS PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
LIB=("$PY" -I "$ROOT/scripts/gpu_check_lib.py")   # stdlib only, not shadowed by PYTHONPATH
# every cache off $HOME (into $WORK, emptied at the start): Triton's kernels, CUDA's JIT,
# torch's, Hugging Face's, pip's; pytest's temp dirs are under $WORK too (pytest_run)
export TRITON_HOME=$WORK/triton TRITON_CACHE_DIR=$WORK/triton/cache CUDA_CACHE_PATH=$WORK/nv \
       PYTORCH_KERNEL_CACHE_PATH=$WORK/torch_kernels TORCHINDUCTOR_CACHE_DIR=$WORK/inductor \
       TORCH_HOME=$WORK/torch HF_HOME=$WORK/hf XDG_CACHE_HOME=$WORK/xdg MPLCONFIGDIR=$WORK/mpl \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)

now_ns() { date +%s%N; }
secs_since() { awk -v a="$1" -v b="$(now_ns)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }'; }
fig() { "${LIB[@]}" fig "$FIGS" "$1" "$2" >/dev/null 2>&1 || true; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
limit() { local l; l=$(left); l=$((l - 15)); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(cap, left - 15)
TO() { local t=$1; shift; timeout -k 10 "$t" "$@"; }   # a stage's command, bounded
at_least_1() { [ "$1" = 0 ] && echo 1 || echo "$1"; }  # a check failed after a command passed
pytest_run() {  # stage-name xml-name args... : pytest with junit XML into $OUT
    TO "$LIMIT" "$PY" -m pytest -p no:cacheprovider -rA --basetemp="$WORK/pytest-$1" \
        --junitxml="$OUT/junit_$2.xml" "${@:3}"
}

run_stage() {  # name cap_seconds [optional] : runs stage_<name>, records it
    local name=$1 cap=$2 opt=${3:-} start rc
    LIMIT=$(limit "$cap")
    echo
    echo "=== stage $name (limit ${LIMIT}s, $(left)s of the budget left) ==="
    "${LIB[@]}" fig "$FIGS" limit_s "$LIMIT" >/dev/null 2>&1 || echo '{}' >"$FIGS"
    if [ "$LIMIT" -lt 20 ]; then
        echo "stage $name: skipped, not enough time left"
        fig note "skipped: $(left)s left of GPU_CHECK_BUDGET_S=$BUDGET"
        "${LIB[@]}" record "$JSON" "$FIGS" "$name" '"skipped"' 0 "$opt"
        return
    fi
    start=$(now_ns)
    "stage_$name"
    rc=$?
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && fig note "timed out after ${LIMIT}s"
    echo "--- stage $name: rc $rc in $(secs_since "$start")s"
    "${LIB[@]}" record "$JSON" "$FIGS" "$name" "$rc" "$(secs_since "$start")" "$opt"
}

stage_0_env() {
    local rc=0 wheels
    if compgen -G ".whl/*.whl" >/dev/null; then
        wheels=$("${LIB[@]}" wheels .whl) || return 1
        mkdir -p /tmp/site
        # shellcheck disable=SC2086
        if "$PY" -m pip --version >/dev/null 2>&1; then
            TO "$LIMIT" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site $wheels || rc=1
        else  # no pip in the image: a wheel is a zip of the site-packages tree
            echo "no pip: unpacking the wheels into /tmp/site"
            "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall("/tmp/site") for w in sys.argv[1:]]' \
                $wheels || rc=1
        fi
        fig wheels "\"$(echo $wheels | xargs -r -n1 basename | tr '\n' ' ')\""
    else
        echo "no .whl/*.whl (scripts/gpu_wheels.sh, carry=[\".whl\"]): using the image's packages"
        fig wheels '"none"'
    fi
    echo "nvidia-smi -L:"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L || rc=1
        fig gpus "\"$(nvidia-smi -L 2>/dev/null | head -4 | tr '\n' ';' | tr -d '"')\""
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,mig.mode.current \
            --format=csv,noheader 2>/dev/null || true
    else
        echo "  nvidia-smi not found"
        rc=1
    fi
    TO "$LIMIT" "$PY" - <<'EOF' || rc=1
import json, os, sys
figs = os.environ["FIGS"]
d = json.load(open(figs)) if os.path.exists(figs) else {}
import torch
d.update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
         cuda_available=torch.cuda.is_available())
try:
    import triton
    d["triton"] = triton.__version__
except ImportError as e:
    d["triton"] = f"missing: {e}"
if torch.cuda.is_available():
    d["device"] = torch.cuda.get_device_name(0)
    d["capability"] = list(torch.cuda.get_device_capability(0))
    d["device_count"] = torch.cuda.device_count()
    torch.ones(1, device="cuda").add_(1).item()      # a kernel runs
ok = torch.cuda.is_available()
try:
    import pydantic, vllm_saguaro.config              # the wheels (or the image's) work
    d["pydantic"] = f"{pydantic.VERSION} ({os.path.dirname(pydantic.__file__)})"
except Exception as e:
    d["pydantic"] = f"FAILED: {type(e).__name__}: {e}"
    ok = False
json.dump(d, open(figs, "w"), indent=2)
print(json.dumps(d, indent=2))
sys.exit(0 if ok else 1)
EOF
    return $rc
}

find_nvcc() {  # nvcc on PATH, else the usual homes (and CUDA_HOME set for torch)
    local d
    command -v nvcc >/dev/null && return 0
    for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13* /opt/cuda; do
        if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
            export CUDA_HOME=$d PATH=$d/bin:$PATH
            return 0
        fi
    done
    return 1
}

stage_1_build() {
    local rc s
    if ! find_nvcc; then
        echo "no nvcc on PATH, under CUDA_HOME or /usr/local/cuda"
        fig nvcc '"missing"'
    else
        fig nvcc "\"$(command -v nvcc): $(nvcc --version | grep -o 'release [^,]*, V[0-9.]*')\""
        nvcc --version | tail -2
    fi
    s=$(now_ns)
    TORCH_CUDA_ARCH_LIST=9.0 SAGUARO_BUILD_CUDA=1 MAX_JOBS=16 \
        TO "$LIMIT" "$PY" setup.py build_ext --inplace
    rc=$?
    fig build_rc "$rc"
    fig build_s "$(secs_since "$s")"
    ls -l vllm_saguaro/_C*.so 2>/dev/null && fig so "\"$(ls vllm_saguaro/_C*.so | head -1)\""
    TO 60 "$PY" - <<'EOF' || rc=1
import json, os, sys, logging
logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("vllm_saguaro.ops.cuda").setLevel(logging.DEBUG)  # why not, if not
from vllm_saguaro.ops import backend, cuda
ok = cuda.available()
figs = os.environ["FIGS"]
d = json.load(open(figs)) if os.path.exists(figs) else {}
d.update(available=ok, backend_cuda=backend("cuda:0"))
json.dump(d, open(figs, "w"), indent=2)
print(f"vllm_saguaro.ops.cuda.available() = {ok}; backend('cuda:0') = {d['backend_cuda']}")
sys.exit(0 if ok else 1)
EOF
    return $rc
}

stage_2_ops() {
    local rc built max
    built=$("$PY" -c 'from vllm_saguaro.ops import cuda; print(int(cuda.available()))' 2>/dev/null || echo 0)
    # on a CUDA torch with the extension: only test_cpu_install_* skips (a CPU-install test)
    max=1
    [ "$built" = 1 ] || max=99
    SAGUARO_OPS_TEST_DEVICE=cuda pytest_run ops ops tests/ops/kernel_checks.py \
        tests/ops/test_cuda_ops.py tests/ops/test_ops.py \
        --deselect tests/ops/test_ops.py::test_triton_kernels_match_references_under_the_interpreter
    rc=$?
    "${LIB[@]}" junit "$FIGS" "$OUT/junit_ops.xml" --max-skipped "$max" \
        --require kernel_checks:8 --require test_ops:13 \
        $([ "$built" = 1 ] && echo --require test_cuda_ops:15) || rc=$(at_least_1 "$rc")
    return $rc
}

stage_3_worker() {
    local rc
    pytest_run worker worker tests/draft/test_worker_gpu.py
    rc=$?
    "${LIB[@]}" junit "$FIGS" "$OUT/junit_worker.xml" --max-skipped 0 \
        --require test_worker_gpu:10 || rc=$(at_least_1 "$rc")
    return $rc
}

stage_4_ops_timing() {
    local rc
    rm -f "$OUT/ops_timing_gpu.json"
    TO "$LIMIT" "$PY" -m benchmarks.ops_timing --device cuda --backends worker,torch,triton,cuda \
        --rows 16,64 --vocab 16384,151936 --repeats 20 --out "$OUT/ops_timing_gpu.json"
    rc=$?
    "${LIB[@]}" timing "$FIGS" "$OUT/ops_timing_gpu.json" || rc=$(at_least_1 "$rc")
    return $rc
}

stage_5_worker_timing() {
    local rc
    rm -f "$OUT/worker_timing_gpu.json"
    TO "$LIMIT" "$PY" scripts/gpu_worker_timing.py --batches 1,4,16 --reps 5 \
        --out "$OUT/worker_timing_gpu.json"
    rc=$?
    "${LIB[@]}" worker-timing "$FIGS" "$OUT/worker_timing_gpu.json" || rc=$(at_least_1 "$rc")
    return $rc
}

main() {
    rm -rf "$WORK"
    mkdir -p "$WORK"
    echo '{}' >"$FIGS"
    "${LIB[@]}" init "$JSON"
    echo "gpu_check.sh: $(date '+%F %T') in $ROOT, OUT=$OUT, budget ${BUDGET}s, $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git status --porcelain 2>/dev/null | grep -q . && echo ' (+ local changes)')"
    export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
    run_stage 0_env 90
    run_stage 1_build 240
    run_stage 2_ops 150
    run_stage 3_worker 120
    run_stage 4_ops_timing 90
    run_stage 5_worker_timing 60 optional
    "${LIB[@]}" summary "$JSON"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
