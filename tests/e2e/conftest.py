"""In-process vLLM engines on tiny models: shared settings so each test stays seconds long."""
import os

import pytest

from vllm_saguaro.vllm_glue.offline import find_proposer as drafter_of  # noqa: F401
from vllm_saguaro.vllm_glue.offline import shutdown as release  # noqa: F401

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ENGINE_KW = dict(enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0,
                 disable_log_stats=False)


def make_llm(target, spec=None, **kw):
    from vllm import LLM

    return LLM(model=str(target), speculative_config=spec, **{**ENGINE_KW, **kw})


def saguaro_counters(llm) -> dict:
    """vLLM's spec-decode counters and ours, as LLM.get_metrics() reports them."""
    from vllm_saguaro.vllm_glue.metrics import _counters

    _counters()  # (re)register ours, so a snapshot taken before any round sees them
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:saguaro_") or m.name.startswith("vllm:spec_decode"):
            if hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0) + m.value
    return out


@pytest.fixture(scope="session")
def spec_base(tiny_draft):
    return {"method": "saguaro", "draft_model": str(tiny_draft), "num_speculative_tokens": 3,
            "draft_dtype": "float32", "fanout": {"policy": "uniform", "width": 3},
            "fallback": "neural", "log_stats_interval_s": 0,
            # K every round unless a test says otherwise: the cache's own tests stay
            # independent of what the controller finds worth sending on tiny models
            "controller": {"policy": "fixed"}}
