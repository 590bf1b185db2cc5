"""Every request feature with SSD on (issue 20, requirement 2).

vLLM 0.32 refuses logit_bias and min_p with any speculative decoding; the plugin lifts
that for its own config and gives the verifier the target's processed p
(patches.patch_logit_bias_and_min_p). Here, through the real engine:
- greedy: one batch mixing every SamplingParams feature gives plain decoding's tokens
  (and logprobs), structured output included, and a prompt that nearly fills the context
  (the speculation must not run past max_model_len); vLLM refuses n > 1 at greedy;
- sampled: the first two tokens follow the exact distribution under logit_bias, min_p,
  penalties, all of them with top-k and n > 1 (chi-square, as test_sampled_lossless.py),
  and structured output at T = 2 follows plain vLLM's own samples (two-sample test: the
  grammar's mask is vLLM's, so plain vLLM is the reference).
"""
import random

import pytest

from tests.e2e.conftest import drafter_of, make_llm, release
from tests.stats import chi_square_pvalue, exact_two_token_distribution, two_sample_pvalue

PROMPT = [1, 17, 42, 99, 300, 7, 250]
N = 1500
ALPHA = 1e-4
MAX_LEN = 512
# Four of the tiny tokenizer's words w1, w10..w19 (tokens 8, 17..26). xgrammar masks by
# string prefix, not by whether the vocabulary can finish the string: with "(w1[0-9]){4}"
# the word w1 is allowed (a prefix of w10) and then nothing is (no token is a digit), so
# vLLM samples from an all -inf row, gets token 0 and ends the request with an error,
# plain decoding as much as SSD (one request in ~10^4 at T = 2). Here every allowed prefix
# can be finished.
REGEX = "(w1[0-9]?){4}"
GRAMMAR_TOKENS = {8, *range(17, 27)}


def _structured(regex=REGEX):
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex)


def structured_sampled():
    """The regex at T = 2: spread over enough (t1, t2) cells for a test with power."""
    return dict(structured_outputs=_structured(), ignore_eos=False, temperature=2.0)


def test_the_regex_never_dead_ends(tiny_target):
    """Every walk the grammar allows can go on (or end) with a token of the vocabulary."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(tiny_target)),
                                              vocab_size=512)
    grammar = xgr.GrammarCompiler(info).compile_regex(REGEX)
    rng = random.Random(0)
    mask = xgr.allocate_token_bitmask(1, 512)
    for _ in range(200):
        matcher = xgr.GrammarMatcher(grammar)
        while not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask)
            allowed = xgr.testing.bitmask_to_bool_mask(mask, 512)[0].nonzero().flatten().tolist()
            assert allowed, "a state of the grammar that no token continues"
            assert matcher.accept_token(rng.choice(allowed))


def greedy_matrix():
    """(prompt, SamplingParams) pairs, one per feature, all at temperature 0."""
    from vllm import SamplingParams

    rng = random.Random(5)

    def prompt(n=None):
        return {"prompt_token_ids": [rng.randrange(7, 512) for _ in range(n or rng.randrange(4, 40))]}

    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    pushed = rng.sample(range(7, 512), 3)   # strong biases: the output is mostly these
    banned = rng.sample(range(7, 512), 200)  # and a ban on many tokens
    cases = {
        "logit_bias_push": dict(logit_bias={t: 12.0 for t in pushed}),
        "logit_bias_ban": dict(logit_bias={t: -100.0 for t in banned}),
        "logit_bias_mild": dict(logit_bias={t: 3.0 for t in rng.sample(range(7, 512), 50)}),
        "min_p": dict(min_p=0.3),
        "penalties": dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5),
        "bias_and_penalties": dict(logit_bias={t: 4.0 for t in pushed}, repetition_penalty=1.3),
        "bad_words": dict(bad_words=["w10", "w20", "w30"]),
        "allowed_tokens": dict(allowed_token_ids=rng.sample(range(7, 512), 40)),
        "logprobs": dict(logprobs=3, prompt_logprobs=2),
        "min_tokens": dict(min_tokens=10, ignore_eos=False, max_tokens=30),
        "stop": dict(stop=["w12", "w13", "w14"], max_tokens=60),
        "structured": dict(structured_outputs=_structured(), ignore_eos=False),
    }
    out = {name: (prompt(), SamplingParams(**{**base, **kw})) for name, kw in cases.items()}
    # a prompt that nearly fills the context: 5 tokens of room for 40 asked
    out["near_max_model_len"] = (prompt(MAX_LEN - 5), SamplingParams(**{**base, "max_tokens": 40}))
    out["near_max_model_len_bias"] = (prompt(MAX_LEN - 3), SamplingParams(
        **{**base, "max_tokens": 40, "logit_bias": {t: 12.0 for t in pushed}}))
    return out


def outputs_of(llm, cases):
    """name -> [(token_ids, text, sampled-token logprobs, finish reason)] per completion,
    and name -> prompt logprobs of the sampled prompt tokens."""
    names = list(cases)
    res = llm.generate([cases[n][0] for n in names], [cases[n][1] for n in names], use_tqdm=False)
    gen, prompt_lp = {}, {}
    for name, r in zip(names, res):
        gen[name] = [(list(c.token_ids), c.text, None if c.logprobs is None else
                      [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], c.finish_reason)
                     for c in r.outputs]
        if r.prompt_logprobs is not None:
            ids = cases[name][0]["prompt_token_ids"]
            prompt_lp[name] = [lp[t].logprob for lp, t in zip(r.prompt_logprobs[1:], ids[1:])]
    return gen, prompt_lp


def sample_pairs(llm, samples=N, **params) -> dict:
    """Counts of the first two sampled tokens (t2 = -1 if a completion stopped at one);
    with params["n"] = m, samples // m requests of m completions each."""
    from vllm import SamplingParams

    m = params.get("n", 1)
    sp = SamplingParams(**{"temperature": 1.0, "max_tokens": 4, "ignore_eos": True,
                           "detokenize": False, **params})
    counts: dict = {}
    for o in llm.generate([{"prompt_token_ids": PROMPT}] * (samples // m), sp, use_tqdm=False):
        assert len(o.outputs) == m
        for c in o.outputs:
            t = list(c.token_ids) + [-1]
            counts[(t[0], t[1])] = counts.get((t[0], t[1]), 0) + 1
    return counts


def sampled_settings(exact_plain):
    """Parameters of the sampled cases; the biases are set on the target's own likely
    tokens so that skipping them in the verifier would move the distribution."""
    top = exact_plain.sum(1).argsort(descending=True).tolist()
    bias = {top[0]: -3.0, top[1]: 2.0, top[5]: 3.0, top[9]: 2.5}
    return {
        "logit_bias": dict(logit_bias=bias),
        "min_p": dict(min_p=0.1, temperature=1.3),
        "penalties": dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4),
        "all_with_topk_n4": dict(logit_bias=bias, min_p=0.05, repetition_penalty=1.2,
                                 frequency_penalty=0.3, top_k=20, temperature=0.9, n=4),
    }


@pytest.fixture(scope="module")
def plain(tiny_target):
    """Plain decoding's answers: the greedy matrix and structured samples at T = 1."""
    llm = make_llm(tiny_target, max_model_len=MAX_LEN, max_num_seqs=256, dtype="float32")
    cases = greedy_matrix()
    gen, prompt_lp = outputs_of(llm, cases)
    structured = sample_pairs(llm, **structured_sampled())
    release(llm)
    return cases, gen, prompt_lp, structured


@pytest.fixture(scope="module")
def ssd(tiny_target, spec_base):
    llm = make_llm(tiny_target, spec_base, max_model_len=MAX_LEN, max_num_seqs=256,
                   dtype="float32")
    yield llm
    release(llm)


def test_every_feature_greedy_identical_to_plain(plain, ssd):
    cases, want, want_prompt_lp, _ = plain
    before = drafter_of(ssd).metrics.lookups
    got, got_prompt_lp = outputs_of(ssd, cases)
    assert drafter_of(ssd).metrics.lookups > before, "SSD did not speculate"
    for name in cases:
        for (tok, text, lps, fin), (wtok, wtext, wlps, wfin) in zip(got[name], want[name]):
            assert tok == wtok, f"{name}: tokens differ from plain decoding"
            assert (text, fin) == (wtext, wfin), name
            if wlps is not None:
                assert lps == pytest.approx(wlps, abs=1e-3), f"{name}: logprobs differ"
    assert got_prompt_lp["logprobs"] == pytest.approx(want_prompt_lp["logprobs"], abs=1e-3)
    # the feature did something: bias pushes, bans and structure hold, the context is full
    pushed = set(cases["logit_bias_push"][1].logit_bias)
    assert sum(t in pushed for t in got["logit_bias_push"][0][0]) >= 3
    assert not set(got["logit_bias_ban"][0][0]) & set(cases["logit_bias_ban"][1].logit_bias)
    import re
    assert re.fullmatch(REGEX, got["structured"][0][1].replace(" ", ""))
    for name in ("near_max_model_len", "near_max_model_len_bias"):
        prompt_len = len(cases[name][0]["prompt_token_ids"])
        assert prompt_len + len(got[name][0][0]) == MAX_LEN and got[name][0][3] == "length"
    # vLLM skips the drafter for the whole batch while a request is within K tokens of
    # max_model_len; requests finished on those steps must still be freed by the draft
    # (they were kept for good, each ~33 KV blocks, and every pre-speculation padded to
    # them). One more request delivers the batch's finished ids: only it may be left.
    from vllm import SamplingParams

    ssd.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    held = drafter_of(ssd).draft_stats()
    assert held["live_seqs"] <= 1 and held["kv_blocks_used"] <= 1, held


def _sampled_ids():
    return ["logit_bias", "min_p", "penalties", "all_with_topk_n4"]


@pytest.mark.parametrize("name", _sampled_ids())
def test_sampled_feature_follows_the_exact_distribution(tiny_target, ssd, name):
    params = sampled_settings(exact_two_token_distribution(tiny_target, PROMPT))[name]
    exact_kw = {k: v for k, v in params.items() if k != "n"}
    exact = exact_two_token_distribution(tiny_target, PROMPT, **exact_kw)
    before = drafter_of(ssd).metrics.lookups
    counts = sample_pairs(ssd, **params)
    assert drafter_of(ssd).metrics.lookups > before, "SSD did not speculate"
    stat, dof, p = chi_square_pvalue(counts, exact, sum(counts.values()))
    print(f"{name}: chi2={stat:.1f} dof={dof} p={p:.3g}")
    assert p > ALPHA, f"{name}: samples do not follow the target distribution (p={p:.3g})"


def test_structured_output_sampled_follows_plain_vllm(plain, ssd):
    _, _, _, want = plain
    got = sample_pairs(ssd, **structured_sampled())
    assert all(a in GRAMMAR_TOKENS and b in GRAMMAR_TOKENS for a, b in got), \
        "a token outside the grammar (or a request ended early)"
    stat, dof, p = two_sample_pvalue(got, want)
    print(f"structured T=2: chi2={stat:.1f} dof={dof} p={p:.3g}")
    assert dof >= 8 and p > ALPHA, f"structured output at T=2 differs from plain vLLM (p={p:.3g})"
