#!/usr/bin/env bash
# Run HERE (a machine with the package registry), before a GPU call: downloads into .whl/
# (git-ignored; carried to the GPU machine with carry=[".whl"]) the wheels of what
# vllm_saguaro's GPU check imports and the GPU image (python 3.12, torch, no network) lacks:
# pydantic and its dependencies, at the versions .venv has (pydantic-core: the exact
# version pydantic pins). typing_extensions is downloaded too; scripts/gpu_check.sh
# installs it only where the image's is older. Then checks, in a process where `ray` and
# `vllm` cannot be imported, that the modules the GPU check imports do not need them.
#   bash scripts/gpu_wheels.sh            (PYTHON: the venv's python, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.whl

ver() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
pin=$("$PY" - <<'EOF'
import importlib.metadata as m, re
for r in m.requires("pydantic") or []:
    hit = re.match(r"\s*pydantic[-_]core\s*==\s*([^;\s]+)", r)
    if hit:
        print(hit.group(1))
        break
EOF
)
core=$(ver pydantic-core)
if [ -z "$pin" ] || [ "$pin" != "$core" ]; then
    echo "gpu_wheels.sh: pydantic $(ver pydantic) pins pydantic-core '${pin:-?}' but .venv has $core" >&2
    exit 1
fi
PKGS=("pydantic==$(ver pydantic)" "pydantic-core==$pin" "annotated-types==$(ver annotated-types)"
      "typing-inspection==$(ver typing-inspection)" "typing-extensions==$(ver typing-extensions)")
echo "gpu_wheels.sh: ${PKGS[*]}"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${PKGS[@]}"
n=$(ls "$DEST"/*.whl | wc -l)
[ "$n" = "${#PKGS[@]}" ] || { echo "gpu_wheels.sh: $n wheels for ${#PKGS[@]} packages" >&2; exit 1; }
ls -l "$DEST"/*.whl | awk '{printf "  %8d  %s\n", $5, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels.sh: $n wheels, $total bytes ($(du -ch "$DEST"/*.whl | tail -1 | cut -f1)) in $DEST/ (carry limit 64 MiB)"

# What the GPU check imports, with ray and vllm made unimportable (None in sys.modules:
# `import ray` then raises ImportError, as on the GPU image).
"$PY" - <<'EOF'
import importlib, pkgutil, sys

for m in ("ray", "vllm"):
    sys.modules[m] = None
before = set(sys.modules)
mods = ["vllm_saguaro", "vllm_saguaro.config", "vllm_saguaro.ops", "vllm_saguaro.ops.cuda",
        "vllm_saguaro.ops.triton_kernels"]
mods += [f"vllm_saguaro.{pkg}.{m.name}" for pkg in ("core", "draft", "ops")
         for m in pkgutil.iter_modules([f"vllm_saguaro/{pkg}"])]
mods += ["tests.tiny_models", "tests.draft.test_worker", "tests.draft.test_worker_gpu",
         "tests.ops.test_ops", "tests.ops.test_cuda_ops", "benchmarks.ops_timing"]
bad = []
for name in mods:
    try:
        importlib.import_module(name)
    except ImportError as e:
        bad.append(f"{name}: {e}")
third = sorted({n.split(".")[0] for n in set(sys.modules) - before}
               - set(sys.stdlib_module_names) - {"vllm_saguaro", "tests", "benchmarks"}
               - {n for n in sys.modules if n.startswith("_")})
print(f"gpu_wheels.sh: {len(mods) - len(bad)}/{len(mods)} modules import without ray/vllm")
print("  third-party modules they load:", ", ".join(third))
for b in bad:
    print("  NEEDS ray/vllm:", b)
sys.exit(1 if bad else 0)
EOF
# module-level (unindented) imports of ray / vllm in what the GPU check imports
if grep -nE '^(import|from) (ray|vllm)\b' vllm_saguaro/__init__.py vllm_saguaro/config.py \
        vllm_saguaro/core/*.py vllm_saguaro/draft/*.py vllm_saguaro/ops/*.py; then
    echo "gpu_wheels.sh: module-level ray/vllm imports above" >&2
    exit 1
fi
echo "gpu_wheels.sh: no module-level ray/vllm import in vllm_saguaro/{config,core,draft,ops}"
