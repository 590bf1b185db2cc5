"""Helpers for offline use of an ``LLM``: SSD's figures for one engine (in-process or
multiprocess), where its threads run, and a clean shutdown before the next engine starts."""
from __future__ import annotations

import gc


def _runner(llm):
    """The model runner of an in-process engine."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("SSD figures per engine need an in-process engine "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0); otherwise read /metrics "
                           "or the 'Saguaro SSD:' log line")
    return core.model_executor.driver_worker.worker.model_runner


def find_proposer(llm):
    """The engine's SaguaroProposer, or None if the engine runs no SSD."""
    from vllm_saguaro.vllm_glue.proposer import SaguaroProposer

    drafter = getattr(_runner(llm), "drafter", None)
    return drafter if isinstance(drafter, SaguaroProposer) else None


def in_process(llm) -> bool:
    return getattr(llm.llm_engine.engine_core, "engine_core", None) is not None


def engine_report(llm) -> dict:
    """The worker's report (proposer.worker_report): the target's threads and, with SSD,
    the proposer's figures, the draft worker's counters and the draft's threads. With a
    multiprocess engine it comes from the worker process (collective_rpc)."""
    from vllm_saguaro.vllm_glue.proposer import worker_report

    if in_process(llm):
        return worker_report(find_proposer(llm), _runner(llm))
    return llm.collective_rpc("saguaro_stats")[0]


def ssd_stats(llm) -> dict:
    """Target-side figures (hit rate, fallbacks, waits) plus the draft worker's own."""
    report = engine_report(llm)
    if "metrics" not in report:
        return {}
    return {**report["metrics"], "draft": report["draft"]}


def shutdown(llm) -> None:
    """Shut an in-process engine (and its draft actor) down now, not whenever GC runs.

    A dropped in-process LLM is collected later, possibly while the next one runs, and its
    shutdown then tears down the new engine's process groups. Shutdown is idempotent.
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    proposer = find_proposer(llm) if in_process(llm) else None
    if proposer is not None:
        proposer.shutdown()
    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()
