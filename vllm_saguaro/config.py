"""SaguaroConfig: the plugin's one configuration model, validated once.

A config comes from a YAML/JSON file path, or a dict with ``method: saguaro`` (what
``--speculative-config`` and ``LLM(speculative_config=...)`` carry). Errors name the
field and the fix; nothing is silently defaulted away.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

METHOD = "saguaro"


class SaguaroConfigError(ValueError):
    """A bad Saguaro config: the message says which field and how to fix it."""


class FanoutConfig(BaseModel):
    """How many verification outcomes to pre-speculate per accepted length k.

    ``geometric`` follows the paper's Theorem 12 for a total ``budget`` of branches per
    sequence; ``uniform`` caches ``width`` bonus-token candidates at every k; ``probable``
    spends ``budget`` x batch branches on the batch's most likely outcomes by the draft's
    own calibrated estimate (core/selection.py).
    """

    model_config = ConfigDict(extra="forbid")

    policy: Literal["geometric", "uniform", "probable"] = Field(
        "probable", description="probable: the batch's most likely outcomes by the draft's "
        "calibrated estimate (hit rate 0.39-0.42 vs 0.20-0.32 geometric at batch 1 on the "
        "reference pair); geometric: Theorem 12; uniform: width per k")
    budget: int = Field(8, ge=1, le=256, description="branches per sequence (geometric, "
                        "probable: budget x batch for the whole batch)")
    width: int = Field(2, ge=1, le=64, description="outcomes per k (uniform)")
    acceptance_rate: float = Field(
        0.6, gt=0.0, lt=1.0, description="prior for the draft's per-token acceptance a_p"
    )
    miss_exponent: float = Field(
        1.0, gt=0.0, description="r in the power-law miss model P(miss | F) = F^-r"
    )
    fit_acceptance: bool = Field(
        True, description="geometric: refit a_p from the verified outcomes as decoding goes "
        "(acceptance_rate is then the prior)")
    fit_to_round: bool = Field(
        True, description="geometric, probable: the per-sequence budget (budget is then the "
        "maximum) shrinks when a step finds the pre-speculation still running and grows "
        "back while it fits the target's round (core/fanout.py BudgetControl)")


class ControllerConfig(BaseModel):
    """The speculation-length controller (core/controller.py): every step, how many draft
    tokens each sequence sends, 0..K, and who drafts a miss, for the most expected tokens
    per second of the batch. ``fixed`` pins K (every sequence sends K tokens every step,
    as plain SD does; the fallback is still chosen by the same objective)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["auto", "fixed"] = Field(
        "auto", description="auto: lengths 0..K per sequence and step from the measured "
        "costs and the calibrated acceptance; fixed: always K")
    token_cost: float = Field(
        0.05, ge=0.0, le=10.0, description="prior cost of one more verified token, as a "
        "fraction of the target's fixed step cost, until the widths seen identify it")
    target_fixed_s: float | None = Field(
        None, gt=0.0, description="measured target step cost: t(w) = target_fixed_s + "
        "target_per_token_s x w (written by `vllm-saguaro tune`; refined online)")
    target_per_token_s: float | None = Field(None, ge=0.0, description="see target_fixed_s")
    idle: bool = Field(
        True, description="while speculation cannot pay at the batch size running (not even "
        "with every lookup a hit), the draft is not called at all: plain decoding")
    lend_cores: bool = Field(
        True, description="CPU: while the draft idles, the target's threads run on the "
        "draft's cores too (vllm_glue/lending.py), so plain decoding has every core")
    objective: Literal["auto", "tokens", "span"] = Field(
        "auto", description="what speculation is for where no request waits to take a "
        "finished one's place. tokens: the batch's tokens per second (each request's own "
        "latency: a server); span: the time until the batch's last request finishes (the "
        "caller waits for all: offline LLM.generate), so a token accepted in a row that "
        "does not hold the batch up is worth little (core/span.py); auto: span in an "
        "engine of vLLM's LLM class, tokens otherwise. Applies to the idle's lookup drafts")
    idle_lookup: bool = Field(
        True, description="while the draft idles, the target's process sends prompt lookup "
        "drafts of its own (continuations of an earlier occurrence of the last tokens) "
        "where the same objective finds they pay (core/idle_lookup.py); not with "
        "fallback 'neural'")
    regime: Literal["ssd", "auto", "lent_sd"] = Field(
        "auto", description="CPU with lend_cores: how a round speculates. ssd: the draft "
        "pre-speculates on its own cores while the target verifies on its own; lent_sd: "
        "synchronous SD, the draft drafts while the target waits (on the target's cores "
        "too) and the target verifies on every core (no pre-speculation); auto: whichever "
        "is expected faster at the batch size running (plain decoding on every core when "
        "neither beats it; SD on the lent cores taken up only 5% ahead, "
        "core/controller.py lent_sd_worth). docs/measurements.md, issue 19's tenth and "
        "eleventh rounds")
    force_idle_lookup: bool = Field(
        False, description="testing switch: the draft idles at every batch size and the "
        "proposer's lookup drafts send every token they have (idle_lookup's losslessness "
        "tests)")
    force_lengths: list[int] | None = Field(
        None, description="testing switch: row i of round r sends force_lengths[(i + r) % n] "
        "tokens (capped by what it has); the losslessness tests use it for mixed lengths")

    @model_validator(mode="after")
    def _prior_pair(self) -> "ControllerConfig":
        if (self.target_fixed_s is None) != (self.target_per_token_s is None):
            raise ValueError("controller.target_fixed_s and target_per_token_s go together "
                             "(both measured by `vllm-saguaro tune`), or neither")
        if self.force_lengths is not None and (not self.force_lengths
                                               or any(x < 0 for x in self.force_lengths)):
            raise ValueError("controller.force_lengths must be a non-empty list of lengths >= 0")
        return self


class SupervisionConfig(BaseModel):
    """What the target does when the draft worker dies, raises or hangs
    (vllm_glue/supervisor.py): it decodes without speculation, starts a new worker in the
    background, and speculates again once that one is up."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        10.0, gt=0.0, description="the shortest wait for a draft reply after which the "
        "draft counts as hung; the bound is the larger of this and timeout_factor x the "
        "slowest of its last 32 replies")
    timeout_factor: float = Field(20.0, ge=1.0, description="see timeout_s")
    restart_s: float = Field(
        5.0, ge=0.0, description="delay from a failure to the new worker's start; doubled "
        "for each further failure in a row (a worker up for 2 minutes resets the count)")
    restart_max_s: float = Field(300.0, ge=0.0, description="the longest restart delay")


class SaguaroConfig(BaseModel):
    """Everything the plugin needs; see configs/saguaro.yaml for a documented example."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    method: Literal["saguaro"] = METHOD
    draft_model: str = Field(..., description="path to a HF Llama/Qwen2/Qwen3 draft checkpoint")
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="K, draft tokens per round")
    fanout: FanoutConfig = Field(default_factory=FanoutConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = Field(
        None, description="vLLM's hand-written schedule, (first batch size, last batch size, "
        "K) per range: the most tokens a sequence may send at that batch size (the "
        "controller chooses below it)")
    saguaro_c: float = Field(
        0.5, ge=0.0, le=1.0, description="C in sigma_{F,C}; 1 = plain draft sampling. Smaller "
        "C: more cache hits, fewer accepted tokens; 0.5 was fastest at T=1 on the reference "
        "pair (benchmarks/results/c_sweep)")
    draft_sampling: Literal["saguaro", "greedy"] = Field(
        "saguaro", description="saguaro: sampled requests draft from sigma_{F,C} and are "
        "verified with that q; greedy: every request drafts argmax tokens, verified with a "
        "one-hot q (vLLM's way for custom proposers; lossless, lower acceptance at T > 0)")
    fallback: Literal["neural", "fast", "auto"] = Field(
        "auto", description="backup speculator on a cache miss: neural (the draft, as in SD), "
        "fast (prompt lookup, nearly free), auto (per step, whichever gives more tokens/s)")
    draft_device: str = Field("cpu", description="'cpu' or 'cuda:N' (a GPU vLLM does not use)")
    draft_cpu_cores: list[int] | None = Field(
        None, description="cores the draft worker is bound to on CPU (default: the last core)"
    )
    draft_dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="auto = bfloat16 on a GPU, float32 on CPU (CPUs without AVX-512 "
        "run bf16 matmuls several times slower than fp32)")
    draft_weights: Literal["auto", "dtype", "fp16"] = Field(
        "auto", description="how the draft's linear layers hold their weights: dtype (as "
        "draft_dtype says), fp16 (CPU only: float16 weights in fbgemm's fp16 GEMM, float32 "
        "activations; 3.4x faster matmuls at batch 1 on an AVX2 core, same agreement on the "
        "reference pair), auto = fp16 on CPU with a float32 draft, else dtype")
    draft_head_tokens: int | None = Field(
        None, ge=2, description="keep only the N most frequent tokens in the draft's output "
        "head (cheaper drafts; q = 0 elsewhere, still lossless); null = full vocabulary")
    async_: bool = Field(
        True, alias="async", description="false = plain synchronous SD in the same worker"
    )
    force_cache_miss: bool = Field(
        False, description="testing switch: every lookup misses, so the fallback drafts"
    )
    draft_runtime: Literal["auto", "process", "ray"] = Field(
        "auto", description="what runs the draft worker: 'process' = a child process of the "
        "target's worker (no daemons beside the target: Ray idle cost plain decoding 2-3% on "
        "CPU), 'ray' = a Ray actor. auto = process when draft_device is cpu, else ray"
    )
    transport: Literal["auto", "ray", "channel"] = Field(
        "auto", description="how q crosses from the draft to the target each round: 'ray' "
        "in the step call's reply (host memory, with either draft_runtime); 'channel' over a "
        "2-rank torch.distributed group of their own (NCCL between GPUs, device to device; "
        "gloo otherwise), the runtime carrying only the call. auto = channel when "
        "draft_device is a GPU, else ray"
    )
    log_stats_interval_s: float = Field(10.0, ge=0.0, description="0 disables the SSD log line")

    @field_validator("draft_model")
    @classmethod
    def _draft_exists(cls, v: str) -> str:
        path = Path(os.path.expanduser(v))
        if not (path / "config.json").is_file():
            raise ValueError(
                f"draft_model {v!r} is not a local HF checkpoint directory (no config.json "
                "there). Give the path of a saved Llama/Qwen checkpoint; models cannot be "
                "fetched from a hub."
            )
        return str(path.resolve())

    @field_validator("draft_device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        if v == "cpu" or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f"draft_device {v!r} must be 'cpu' or 'cuda:N' (e.g. 'cuda:1')")

    @model_validator(mode="after")
    def _cores_only_on_cpu(self) -> "SaguaroConfig":
        if self.draft_cpu_cores is not None:
            if self.draft_device != "cpu":
                raise ValueError("draft_cpu_cores applies only when draft_device is 'cpu'")
            if not self.draft_cpu_cores or any(c < 0 for c in self.draft_cpu_cores):
                raise ValueError("draft_cpu_cores must be a non-empty list of core ids >= 0")
        if self.draft_weights == "fp16" and self.draft_device != "cpu":
            raise ValueError("draft_weights 'fp16' is a CPU kernel (fbgemm); on a GPU use "
                             "draft_dtype (bfloat16 by default) and draft_weights 'dtype'")
        return self

    def to_json_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json(by_alias=True))


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid Saguaro speculative config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        model, field = _field_at(e["loc"])
        if e["type"] == "extra_forbidden":
            known = ", ".join(sorted(f.alias or n for n, f in model.model_fields.items()))
            msg = f"unknown key; known keys: {known}"
        else:
            msg = e["msg"]
            if field is not None and field.description:
                msg += f" (the field: {field.description})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _field_at(loc: tuple):
    """The model an error's `loc` points into and the field there (None for a key the
    model does not have): the path goes through the nested models (fanout, ...)."""
    model: type[BaseModel] = SaguaroConfig
    for i, part in enumerate(loc):
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        field = fields.get(part) if isinstance(part, str) else None
        if field is None:
            return model, None
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        if not nested or i == len(loc) - 1:
            return model, field
        model = field.annotation
    return model, None


def looks_like_config_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike)) and str(value).endswith((".yaml", ".yml", ".json"))


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise SaguaroConfigError(f"speculative config file {str(path)!r} does not exist")
    data = yaml.safe_load(p.read_text())  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise SaguaroConfigError(f"speculative config file {str(path)!r} must hold a mapping")
    return data


def is_saguaro_spec(value: Any) -> bool:
    """True if a ``speculative_config`` value asks for this plugin."""
    if looks_like_config_path(value):
        return read_config_file(value).get("method") == METHOD
    return isinstance(value, dict) and value.get("method") == METHOD


def load_config(value: str | os.PathLike | dict[str, Any] | SaguaroConfig) -> SaguaroConfig:
    """Validate a path, dict or config once; raise SaguaroConfigError with every problem."""
    if isinstance(value, SaguaroConfig):
        return value
    source = "dict"
    if looks_like_config_path(value):
        source = str(value)
        value = read_config_file(value)
    if not isinstance(value, dict):
        raise SaguaroConfigError(
            f"speculative config must be a YAML/JSON file path or a mapping, got {value!r}"
        )
    data = {k.replace("-", "_") if k != "async" else k: v for k, v in value.items()}
    try:
        return SaguaroConfig.model_validate(data)
    except ValidationError as err:
        raise SaguaroConfigError(_format_errors(err, source)) from None
