"""Benchmarks and reference assets for vllm-saguaro (not part of the plugin package)."""
