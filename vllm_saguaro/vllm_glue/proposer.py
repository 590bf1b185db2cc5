"""Target-side client of the draft worker: outcomes out, speculations in.

vLLM builds it as a ``custom_class`` drafter; patches.py routes the runner's draft call to
``propose_round`` so that it sees request ids and finished requests. The only wait on the
draft is at the top of each round (for the pre-speculation of the round just verified
and then the lookup); that wait is measured.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass

import torch

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.outcome import is_consistent
from vllm_saguaro.core.sampling import SamplingSpec
from vllm_saguaro.draft.model import check_draft_vocabulary
from vllm_saguaro.vllm_glue.metrics import SaguaroMetrics

logger = logging.getLogger("vllm_saguaro")


@dataclass
class _Mirror:
    """What the draft worker holds for a request, so mismatches are caught here."""

    num_tokens: int
    spec: list[int]


def _explicit_target_cores() -> set[int] | None:
    """Cores the user bound the target to with VLLM_CPU_OMP_THREADS_BIND, if any."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind", "all"):
        return None
    from vllm.utils.cpu_resource_utils import parse_id_list

    return {c for part in bind.split("|") for c in parse_id_list(part)}


def choose_draft_cores(cfg: SaguaroConfig, process_cores: set[int],
                       bound: set[int] | None) -> tuple[list[int], set[int]]:
    """(draft cores, target cores): the draft gets cores the target's threads do not use.

    Cores the user bound the target to (``bound``) are never taken; otherwise the draft
    takes a free core, or carves the highest core out of the target process's set.
    """
    target = bound if bound is not None else process_cores
    if cfg.draft_cpu_cores is not None:
        draft = list(cfg.draft_cpu_cores)
        clash = sorted(set(draft) & (bound or set()))
        if clash:
            raise ValueError(
                f"draft_cpu_cores {draft} overlap the cores the target is bound to "
                f"({sorted(bound)}, VLLM_CPU_OMP_THREADS_BIND): give the draft cores of its own")
    else:
        free = sorted(set(range(os.cpu_count() or 1)) - target)
        draft = [free[-1]] if free else [max(target)]
    rest = target - set(draft)
    if not rest:
        raise ValueError(
            f"no CPU core is left for the target: it has {sorted(target)} and the draft takes "
            f"{draft}. SSD on CPU needs at least two cores (one for the draft).")
    return draft, rest


def _bind_target(cores: set[int]) -> None:
    """Keep the target's threads off the draft's cores (in-process engines are unbound)."""
    import torch

    if set(os.sched_getaffinity(0)) != cores:
        os.sched_setaffinity(0, cores)
        torch._C.set_num_threads(len(cores))  # vLLM's CPU worker stubs torch.set_num_threads
        logger.info("Saguaro: target threads bound to cores %s", sorted(cores))


def check_draft_gpu(cfg: SaguaroConfig, target_device) -> None:
    """cuda:N counts in the target process's visible devices (CUDA_VISIBLE_DEVICES)."""
    dev = torch.device(target_device)
    if dev.type != "cuda":
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if cfg.draft_device == f"cuda:{index}":
        raise ValueError(
            f"draft_device {cfg.draft_device} is the target's own device; SSD needs the draft "
            "on a device of its own (another GPU)")


class SaguaroProposer:
    def __init__(self, vllm_config):
        extra = vllm_config.additional_config or {}
        if "saguaro" not in extra:
            raise ValueError("SaguaroProposer needs additional_config['saguaro']; use "
                             "speculative_config with method 'saguaro'")
        self.cfg = SaguaroConfig.model_validate(extra["saguaro"])
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.target_device = getattr(vllm_config.device_config, "device", "cpu")
        self.actor = None
        self.pending = None          # ObjectRef of the last pre-speculation
        self.mirror: dict[str, _Mirror] = {}
        self.metrics = SaguaroMetrics(self.cfg.log_stats_interval_s)

    # vLLM calls this once the target is loaded; the draft starts then, on its own device.
    def load_model(self, target_model=None) -> None:
        import ray

        from vllm_saguaro.draft.worker import make_ray_worker

        cfg = self.cfg.model_copy()
        check_draft_vocabulary(cfg.draft_model, self.vocab_size)  # here, not in the actor
        if cfg.draft_device == "cpu":
            bound = _explicit_target_cores()
            cfg.draft_cpu_cores, target = choose_draft_cores(
                cfg, set(os.sched_getaffinity(0)), bound)
            if bound is None:
                _bind_target(target)
        else:
            check_draft_gpu(cfg, self.target_device)
        self.actor = make_ray_worker(cfg.to_json_dict(), self.vocab_size)
        ray.get(self.actor.ping.remote())  # surface load errors (bad checkpoint, vocab) now
        weakref.finalize(self, _kill, self.actor)
        logger.info("Saguaro draft worker ready (%s, cores %s, K=%d, fan-out %s, async=%s)",
                    cfg.draft_device, cfg.draft_cpu_cores, cfg.num_speculative_tokens,
                    cfg.fanout.policy, cfg.async_)

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-saguaro's runner patch is not active: was the plugin loaded?")

    def propose_round(self, req_ids: list[str], num_tokens, token_ids_cpu,
                      sampled_token_ids: list[list[int]], finished: set[str],
                      sampling_of) -> tuple[list[list[int]], torch.Tensor | None]:
        """One round: send each request's outcome (or its tokens on a resync), get drafts.

        Returns the drafts per row and, when any request samples, the draft distributions
        q [rows, K, V] the verifier must use (one-hot rows for greedy requests, which the
        rejection sampler verifies by argmax anyway). sampling_of(req_id) gives a new
        request's SamplingSpec.
        """
        import ray

        if self.actor is None:
            self.load_model()
        for rid in finished:
            self.mirror.pop(rid, None)
        updates, rows = [], []
        for row, (rid, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            if not sampled:  # still prefilling, or nothing to continue from
                continue
            n = int(num_tokens[row])
            m = self.mirror.get(rid)
            if m is not None and m.num_tokens + len(sampled) == n and is_consistent(sampled, m.spec):
                updates.append((rid, list(sampled), None, None))
            else:  # new, preempted-and-resumed, or out of step: the draft re-prefills
                spec = sampling_of(rid) if self.cfg.draft_sampling == "saguaro" else SamplingSpec()
                updates.append((rid, None, token_ids_cpu[row, :n].tolist(), tuple(spec)))
            rows.append((row, rid, n))
        drafts: list[list[int]] = [[] for _ in req_ids]
        if self.pending is not None:  # the last pre-speculation: surface its failure, if any
            done, _ = ray.wait([self.pending], timeout=0)
            if done:
                ray.get(done[0])
                self.pending = None
        t0 = time.perf_counter()
        results, waited = ray.get(self.actor.step.remote(updates, sorted(finished))) \
            if (updates or finished) else ([], 0.0)
        t1 = time.perf_counter()
        for (row, rid, n), (tokens, _, _) in zip(rows, results):
            drafts[row] = tokens
            self.mirror[rid] = _Mirror(n, tokens)
        if self.cfg.async_ and rows:
            self.pending = self.actor.prespeculate.remote()
        if rows:
            self.metrics.record_round([flag for _, flag, _ in results], waited, t1 - t0 - waited)
        return drafts, self._draft_probs(len(req_ids), rows, results)

    def _draft_probs(self, num_rows: int, rows, results) -> torch.Tensor | None:
        if all(q is None for _, _, q in results):
            return None
        probs = torch.zeros(num_rows, self.cfg.num_speculative_tokens, self.vocab_size)
        for (row, _, _), (tokens, _, q) in zip(rows, results):
            if q is None:  # greedy request: q one-hot on the drafted tokens
                probs[row, torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            else:
                probs[row, : len(tokens)].numpy()[...] = q  # Ray's arrays are read-only
        return probs

    def draft_stats(self) -> dict:
        """The draft worker's own counters (pre-speculation time, branches, ...)."""
        import ray

        return ray.get(self.actor.get_stats.remote())

    def shutdown(self) -> None:
        if self.actor is not None:
            _kill(self.actor)
            self.actor = None


def _kill(actor) -> None:
    try:
        import ray

        if ray.is_initialized():  # after ray.shutdown, ray.kill would start a new cluster
            ray.kill(actor)
    except Exception:  # interpreter shutdown: Ray may already be gone
        pass
