"""The real pair (SmolLM2-135M-Instruct + the distilled draft): SSD output is identical to
plain greedy decoding on real prompts, with the cut draft head the demo uses."""
import pytest

from benchmarks.reference_pair import HEAD_TOKENS
from tests.e2e.conftest import drafter_of, make_llm, release


@pytest.fixture(scope="module")
def pair():
    from benchmarks.reference_pair import build_reference_pair

    return build_reference_pair()


def test_reference_pair_greedy_identical(pair):
    from vllm import SamplingParams

    from benchmarks.prompts import load_prompt_sets

    target, draft = pair
    prompts = [p for ps in load_prompt_sets(target, limit=1).values() for p in ps]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=1024, max_num_seqs=2)
    llm = make_llm(target, **kw)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    release(llm)
    spec = {"method": "saguaro", "draft_model": draft, "num_speculative_tokens": 3,
            "draft_head_tokens": HEAD_TOKENS, "fanout": {"policy": "geometric", "budget": 4},
            "log_stats_interval_s": 0}
    llm = make_llm(target, spec, **kw)
    ssd = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    m = drafter_of(llm).metrics
    release(llm)
    assert ssd == plain
    assert m.lookups > 0
