"""vllm-saguaro: speculative speculative decoding (SSD) with Saguaro for vLLM 0.32."""

__version__ = "0.1.0"
SUPPORTED_VLLM = "0.32"
