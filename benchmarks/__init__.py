"""Benchmarks and reference assets for vllm-saguaro (not part of the plugin package)."""
from __future__ import annotations

import json
from pathlib import Path


def write_json_out(path: str | None, result) -> None:
    """A benchmark's --json-out: `result` as indented JSON at `path` (nothing if None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
