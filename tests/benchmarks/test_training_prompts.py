"""The draft's training prompts never contain an evaluation prompt (MT-Bench, HumanEval).

Agreement is reported on MT-Bench first turns and HumanEval prompts; a training prompt that
repeats one would make that figure a training-set score.
"""
import re

import pytest

from benchmarks.prompts import humaneval_prompts, mt_bench_questions
from benchmarks.reference_pair.prompts import MIXES, build_prompts


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_no_evaluation_prompt_in_training_prompts(mix):
    prompts = build_prompts(3000, seed=1, mix=mix)
    assert {p["kind"] for p in prompts} == {k for _, k in MIXES[mix]}
    train = [_norm(p["text"]) for p in prompts]
    evals = [_norm(q) for q in mt_bench_questions()] + [_norm(p)[:200] for p in humaneval_prompts()]
    assert len(evals) > 200
    leaked = [e[:80] for e in evals if any(e in t or t in e for t in train)]
    assert not leaked, leaked[:3]
