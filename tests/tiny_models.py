"""Tiny random checkpoints that vLLM and the draft worker both load, built in seconds.

No model hub is reachable, so tests build their own: a word-level tokenizer over
`vocab` words and a random Llama whose LM head is scaled so next-token distributions
are peaked (random models are otherwise near-uniform and every test is a coin toss).
"""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def save_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", ":", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def make_tiny_llama(path: str | Path, *, vocab: int = 512, layers: int = 2, hidden: int = 128,
                    heads: int = 2, kv_heads: int = 1, seed: int = 0, head_scale: float = 25.0,
                    base: str | Path | None = None, noise: float = 0.0) -> Path:
    """A random Llama (head_dim 64, as CPU attention needs). With `base`, a perturbed copy."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    else:
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=hidden // heads,
                          max_position_embeddings=2048, tie_word_embeddings=False,
                          bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(path, model.config.vocab_size)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
