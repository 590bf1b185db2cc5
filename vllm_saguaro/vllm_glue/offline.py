"""Helpers for offline use of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
SSD's figures for one engine, and a clean shutdown before the next engine starts."""
from __future__ import annotations

import gc


def find_proposer(llm):
    """The engine's SaguaroProposer, or None if the engine runs no SSD."""
    from vllm_saguaro.vllm_glue.proposer import SaguaroProposer

    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError("SSD figures per engine need an in-process engine "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0); otherwise read /metrics "
                           "or the 'Saguaro SSD:' log line")
    runner = core.model_executor.driver_worker.worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, SaguaroProposer) else None


def ssd_stats(llm) -> dict:
    """Target-side figures (hit rate, fallbacks, waits) plus the draft worker's own."""
    proposer = find_proposer(llm)
    if proposer is None:
        return {}
    return {**proposer.metrics.as_dict(), "draft": proposer.draft_stats()}


def shutdown(llm) -> None:
    """Shut an in-process engine (and its draft actor) down now, not whenever GC runs.

    A dropped in-process LLM is collected later, possibly while the next one runs, and its
    shutdown then tears down the new engine's process groups. Shutdown is idempotent.
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    proposer = find_proposer(llm)
    if proposer is not None:
        proposer.shutdown()
    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()
