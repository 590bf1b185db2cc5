"""The draft model: a plain-torch Llama / Qwen2 / Qwen3 forward over paged context KV.

One forward serves every draft pass (prefill, glue, fallback decode, tree decode): the
caller passes the gathered context KV, any earlier scratch KV, and one boolean mask over
[context | scratch | new tokens]. The tree mask of the paper is just such a mask.
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm_saguaro.draft.linear import Linear, fused

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")

KV = tuple[torch.Tensor, torch.Tensor]  # each [N, Hkv, L, D]

# Attention on CUDA, with the draft's boolean mask and grouped KV heads. Left to choose,
# torch takes cuDNN attention for bf16, which builds a new cuDNN graph for every new shape;
# the draft's shapes change every call (the context grows by a token, the tree's width
# varies), so each call paid ~60 ms of planning on an H200 (scripts/gpu_check.sh, stage 5:
# 215 ms a pre-speculation in bf16 against 9 ms in fp32). Memory-efficient attention takes
# the mask but not grouped heads, so on CUDA the KV heads are repeated to the query's
# (as enable_gqa does, head h reading KV head h // group) and cuDNN is left out.
CUDA_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@dataclass
class DraftSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_dir(cls, path: str | Path) -> "DraftSpec":
        cfg = json.loads((Path(path) / "config.json").read_text())
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"draft model type {mtype!r} is not supported; use one of {SUPPORTED_TYPES}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"draft rope type {rope_type!r} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=mtype,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            qk_norm=mtype == "qwen3",
        )


def check_draft_vocabulary(path: str | Path, target_vocab_size: int) -> DraftSpec:
    """SSD needs the target's tokenizer: refuse a draft whose vocabulary differs."""
    spec = DraftSpec.from_dir(path)
    if spec.vocab_size != target_vocab_size:
        raise ValueError(
            f"draft_model {path} has a vocabulary of {spec.vocab_size} tokens but the target "
            f"has {target_vocab_size}: SSD needs a draft with the target's tokenizer")
    return spec


def _tokenizer_vocab(path: Path) -> dict | None:
    """The token -> id map of a checkpoint's tokenizer.json (None if it has none)."""
    f = path / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        model = json.loads(f.read_text()).get("model", {})
    except (OSError, ValueError):
        return None
    vocab = model.get("vocab")
    return vocab if isinstance(vocab, dict) else None


def _target_vocab_size(target: Path) -> int | None:
    try:
        cfg = json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return None  # vLLM reports the target's own problems
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def check_draft_checkpoint(path: str | Path, target: str | Path | None = None) -> DraftSpec:
    """Before any engine process starts: the draft checkpoint can be read (config.json,
    safetensors headers) and speaks the target's tokenizer (vocabulary size and, where
    both ship a tokenizer.json, the same vocabulary). Raises ValueError naming
    draft_model and the fix; the weights are not loaded here."""
    path = Path(path)
    try:
        spec = DraftSpec.from_dir(path)
    except (ValueError, KeyError, TypeError) as err:  # JSON errors are ValueErrors
        raise ValueError(f"draft_model {path}: config.json is not a usable Llama/Qwen "
                         f"config ({type(err).__name__}: {err}); re-save the draft "
                         "checkpoint with save_pretrained") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"draft_model {path}: no *.safetensors weights; save the draft "
                         "with save_pretrained(safe_serialization=True)")
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # a truncated or foreign file
            raise ValueError(f"draft_model {path}: {f.name} is not a readable safetensors "
                             f"file ({err}); copy or save the checkpoint again") from None
    if target is not None and Path(target).is_dir():
        size = _target_vocab_size(Path(target))
        if size is not None:
            check_draft_vocabulary(path, size)
        mine, theirs = _tokenizer_vocab(path), _tokenizer_vocab(Path(target))
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(
                f"draft_model {path} ships another tokenizer than the target {target} "
                "(their tokenizer.json vocabularies differ): SSD needs a draft trained "
                "with the target's tokenizer")
    return spec


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _inv_freq(spec: DraftSpec) -> torch.Tensor:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = spec.rope_scaling
    if s:  # Llama 3.x frequency-dependent scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DraftModel:
    """Weights as plain tensors; forward() is the whole model."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", head_tokens: int | None = None,
                 quantization: str = "none"):
        path = Path(path)
        self.spec = spec = DraftSpec.from_dir(path)
        self.dtype, self.device = dtype, torch.device(device)
        self.expand_kv = self.device.type == "cuda"  # CUDA_ATTENTION's way; a test sets it on CPU
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in _load_weights(path).items()}

        def get(name: str) -> torch.Tensor:
            if name not in w:
                raise KeyError(f"draft checkpoint {path} lacks weight {name!r}")
            return w[name]

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = w.get("lm_head.weight", self.embed if spec.tie_embeddings else None)
        if self.lm_head is None:
            raise KeyError(f"draft checkpoint {path} has no lm_head and untied embeddings")
        # The output head of a small draft costs as much as many layers (576 x 49152 is
        # ~8 layers of SmolLM2): keeping only the most frequent tokens makes it cheap. The
        # draft then never proposes other tokens (q = 0 there), which stays lossless.
        self.head_ids = None
        if head_tokens is not None and head_tokens < self.lm_head.shape[0]:
            self.head_ids = frequent_token_ids(path, head_tokens).to(self.device)
            self.lm_head = self.lm_head[self.head_ids].contiguous()
        self.quantization = quantization
        self.head = Linear(self.lm_head, quantization=quantization)
        self.final_norm = get("model.norm.weight")
        # q/k/v and gate/up are one matmul each: fewer, larger calls (a CPU draft forward
        # at batch 1 pays per call), and the split widths below.
        self.qkv_split = [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            proj = ("q_proj", "k_proj", "v_proj")
            layer = {
                "qkv": fused([get(f"{p}self_attn.{n}.weight") for n in proj],
                             [w.get(f"{p}self_attn.{n}.bias") for n in proj], quantization),
                "o_proj": Linear(get(p + "self_attn.o_proj.weight"), quantization=quantization),
                "gate_up": fused([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")],
                                 [None, None], quantization),
                "down_proj": Linear(get(p + "mlp.down_proj.weight"), quantization=quantization),
                "input_layernorm": get(p + "input_layernorm.weight"),
                "post_attention_layernorm": get(p + "post_attention_layernorm.weight"),
            }
            if spec.qk_norm:
                layer["self_attn.q_norm"] = get(p + "self_attn.q_norm.weight")
                layer["self_attn.k_norm"] = get(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        self.inv_freq = _inv_freq(spec).to(self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                context: list[KV] | None = None, scratch: list[KV] | None = None,
                stop=None) -> tuple[torch.Tensor, list[KV]] | None:
        """input_ids/positions [N, T]; mask [N, 1, T, Lctx + Lscratch + T] (True = attend).

        Returns the final-normed hidden states [N, T, hidden] and each layer's new KV, or
        None if stop() turned true between two layers (a pre-speculation cut short).
        """
        x = self.embed[input_ids]
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [N, T, D/2]
        cos = freqs.cos()[:, None].to(self.dtype)
        sin = freqs.sin()[:, None].to(self.dtype)
        with sdpa_kernel(CUDA_ATTENTION) if self.expand_kv else contextlib.nullcontext():
            return self._layers(x, cos, sin, mask, context, scratch, stop)

    def _layers(self, x, cos, sin, mask, context, scratch, stop):
        """The decoder layers and the final norm: forward's body, under its attention."""
        s = self.spec
        n, t = x.shape[:2]
        expand = self.expand_kv and s.num_heads != s.num_kv_heads
        group = s.num_heads // s.num_kv_heads
        new_kv: list[KV] = []
        for i, L in enumerate(self.layers):
            if stop is not None and stop():
                return None
            h = _rms(x, L["input_layernorm"], s.rms_eps)
            q, k, v = L["qkv"](h).to(self.dtype).split(self.qkv_split, dim=-1)
            q = q.view(n, t, s.num_heads, s.head_dim).transpose(1, 2)
            k = k.view(n, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            v = v.view(n, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            if s.qk_norm:
                q = _rms(q, L["self_attn.q_norm"], s.rms_eps)
                k = _rms(k, L["self_attn.k_norm"], s.rms_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            new_kv.append((k, v))
            ks, vs = [], []
            if context is not None:
                ks.append(context[i][0]); vs.append(context[i][1])
            if scratch is not None:
                ks.append(scratch[i][0]); vs.append(scratch[i][1])
            ks.append(k); vs.append(v)
            kk = torch.cat(ks, dim=2) if len(ks) > 1 else k
            vv = torch.cat(vs, dim=2) if len(vs) > 1 else v
            if expand:
                kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=not expand)
            a = a.transpose(1, 2).reshape(n, t, s.num_heads * s.head_dim)
            x = x + L["o_proj"](a).to(self.dtype)
            h = _rms(x, L["post_attention_layernorm"], s.rms_eps)
            gate, up = L["gate_up"](h).chunk(2, dim=-1)
            x = x + L["down_proj"](F.silu(gate) * up).to(self.dtype)
        return _rms(x, self.final_norm, s.rms_eps), new_kv

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's tokens; token_ids() maps their indices to vocabulary ids."""
        return self.head(hidden).float()

    def token_ids(self, head_index: torch.Tensor) -> torch.Tensor:
        return head_index if self.head_ids is None else self.head_ids[head_index]

    def head_index(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index in the head, whether the token is in it) of vocabulary ids; the fast
        backup may draft tokens a cut head lacks. On token_ids' device (head_ids are on
        the draft's)."""
        if self.head_ids is None:
            return token_ids, torch.ones_like(token_ids, dtype=torch.bool)
        ids = token_ids.to(self.head_ids.device)
        idx = torch.searchsorted(self.head_ids, ids).clamp(max=len(self.head_ids) - 1)
        return idx.to(token_ids.device), (self.head_ids[idx] == ids).to(token_ids.device)


FREQUENCY_FILE = "token_frequencies.json"


def frequent_token_ids(path: Path, n: int) -> torch.Tensor:
    """The n most frequent token ids: from the draft's token_frequencies.json (ids sorted by
    frequency, written when the draft is trained) or else the n lowest ids, which for BPE
    vocabularies are the earliest, most frequent merges."""
    f = Path(path) / FREQUENCY_FILE
    if f.is_file():
        ids = json.loads(f.read_text())[:n]
    else:
        ids = list(range(n))
    return torch.tensor(sorted(ids), dtype=torch.long)
