"""A real CPU reference pair: SmolLM2-135M-Instruct (target) and a small distilled draft.

`build_reference_pair(cache_dir=None) -> (target_path, draft_path)` builds both as plain
HF LlamaForCausalLM checkpoints, offline; see README.md in this folder.
"""

# The committed draft was distilled for a cut output head (the most frequent tokens, in
# token_frequencies.json): run it with draft_head_tokens = HEAD_TOKENS.
HEAD_TOKENS = 16384


def build_reference_pair(cache_dir=None):
    """Lazy wrapper (keeps `python -m benchmarks.reference_pair.build` free of runpy warnings)."""
    from benchmarks.reference_pair.build import build_reference_pair as _build

    return _build(cache_dir)


__all__ = ["HEAD_TOKENS", "build_reference_pair"]
