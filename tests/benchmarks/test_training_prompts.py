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


class _CannedLLM:
    """Stands in for vLLM's LLM: answers every list prompt with the next canned request."""

    def __init__(self, texts):
        self.texts, self.asked = list(texts), []

    def generate(self, prompts, sp, use_tqdm=False):
        from types import SimpleNamespace

        self.asked += prompts
        return [SimpleNamespace(outputs=[SimpleNamespace(text=self.texts.pop(0) if self.texts else "")]) for _ in prompts]


def test_self_instruct_keeps_new_requests_and_drops_eval_text():
    from benchmarks.reference_pair.self_instruct import SEEDS, generate_requests

    mt = mt_bench_questions()[5]
    canned = [" Explain how a kite flies.", " Explain how a kite flies.",           # a duplicate
              " " + mt, " Please " + mt[:60].lower() + " now.",                      # eval text, whole or 6 words of it
              " " + SEEDS["math"][0], " Write a", " ???????????????",                # a seed copy, unfinished, no words
              " Describe a walk through a rainy forest.", " What is a prime number?"]
    llm = _CannedLLM(canned)
    reqs = generate_requests(llm, 10, seed=0, rounds=1, say=lambda m: None)
    texts = [p["text"] for p in reqs]
    assert [t.split("?")[0].split(".")[0] for t in texts] == [
        "Explain how a kite flies", "Describe a walk through a rainy forest", "What is a prime number"]
    assert all(p["chat"] and p["kind"].startswith("self_") and p["kind"][5:] in SEEDS for p in reqs)
    assert llm.asked and all(a.rstrip().endswith("4.") and "requests that people sent" in a for a in llm.asked)


def test_text_requests_carry_a_text_and_drop_eval_text():
    from benchmarks.reference_pair.self_instruct import eval_shingles
    from benchmarks.reference_pair.text_requests import MANY_TEXTS, ONE_TEXT, text_requests

    texts = [f"Passage {i} talks about topic number {i}. It has a second sentence. And a third one." for i in range(20)]
    leak = mt_bench_questions()[52]
    reqs = text_requests(texts + [leak], 300, seed=0, banned=eval_shingles())
    assert len(reqs) == 300 and all(p["chat"] and p["kind"] == "text_extraction" for p in reqs)
    assert not any(leak[:60] in p["text"] for p in reqs)  # the evaluation text never gets through
    one = [p for p in reqs if any(i in p["text"] for i in ONE_TEXT)]
    many = [p for p in reqs if any(i in p["text"] for i in MANY_TEXTS)]
    assert len(one) + len(many) == 300 and one and many
    assert all(any(t in p["text"] for t in texts) for p in one)  # the whole passage is in the request
    assert all(p["text"].count("Passage ") >= 2 for p in many)  # a numbered set of at least two


def test_self_instruct_weights_tilt_the_categories_and_bad_ones_are_refused():
    from collections import Counter

    from benchmarks.reference_pair.self_instruct import SEEDS, generate_requests, parse_weights

    w = parse_weights("writing=3,math=0")
    assert w["writing"] == 3 and w["math"] == 0 and w["stem"] == 1 and set(w) == set(SEEDS)
    canned = [f" Tell me about thing number {i} please." for i in range(400)]
    reqs = generate_requests(_CannedLLM(canned), 200, seed=0, rounds=1, say=lambda m: None, weights=w)
    kinds = Counter(p["kind"][5:] for p in reqs)
    assert len(reqs) == 200 and kinds["math"] == 0
    assert kinds["writing"] > 2 * max(kinds[c] for c in SEEDS if c != "writing")  # 3/9 against 1/9 each
    for bad, says in [("poetry=1", "NAME one of"), ("writing", "NAME one of"), ("writing=-1", ">= 0"),
                      ("writing=abc", "writing must be a number"), ("math=nan", ">= 0"), ("stem=inf", "finite"),
                      (",".join(f"{c}=0" for c in SEEDS), "all zero")]:
        with pytest.raises(ValueError, match=says):
            parse_weights(bad)
    assert parse_weights(None) is None and parse_weights("") is None
