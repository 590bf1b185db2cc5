import torch

from vllm_saguaro.core.sampling import (SamplingSpec, draft_distribution, saguaro_sigma,
                                        top_k_top_p_mask)


def test_sigma_scales_top_tokens_and_renormalises():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = logits.softmax(-1)
    s = saguaro_sigma(p, logits, torch.tensor([1]), 0.5)  # F=1 -> top-2 scaled
    expected = p * torch.tensor([0.5, 0.5, 1.0, 1.0])
    torch.testing.assert_close(s, expected / expected.sum())
    torch.testing.assert_close(saguaro_sigma(p, logits, torch.tensor([1]), 1.0), p)
    zero = saguaro_sigma(p, logits, torch.tensor([1]), 0.0)
    assert zero[0, :2].sum() == 0 and torch.isclose(zero.sum(), torch.tensor(1.0))


def test_sigma_per_row_fanout_and_degenerate_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, -1.0]])
    p = logits.softmax(-1)
    s = saguaro_sigma(p, logits, torch.tensor([0, 2]), 0.0)
    assert s[0, 1] == 0 and s[0].sum().isclose(torch.tensor(1.0))  # only the top-1 removed
    torch.testing.assert_close(s[1], p[1])  # all mass in the top-3: keep the unscaled row


def test_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_k_top_p_mask(logits, 2, 1.0)[0, 2:]).all()
    m = top_k_top_p_mask(logits, 0, 0.8)   # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(m[0, :2]).all() and torch.isinf(m[0, 2:]).all()
    m = top_k_top_p_mask(logits, 0, 0.81)
    assert torch.isfinite(m[0, :3]).all() and torch.isinf(m[0, 3])


def test_draft_distribution_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    q = draft_distribution(logits, SamplingSpec(temperature=2.0), torch.tensor([0]), 1.0)
    torch.testing.assert_close(q, (logits / 2).softmax(-1))
    assert SamplingSpec(0.0).greedy and not SamplingSpec(0.7).greedy
    assert SamplingSpec(0.7, seed=3).seeded
    assert not SamplingSpec(0.7).seeded and not SamplingSpec(0.0, seed=3).seeded


def test_quantized_q_is_exact_on_both_sides_and_sums_to_one():
    from vllm_saguaro.core.sampling import (Q_SCALE, from_wire, quantize_distribution,
                                            wire_counts)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16384, generator=g) * 3
    q = torch.softmax(logits, -1)
    qq = quantize_distribution(q)
    assert (qq.sum(-1) == 1.0).all(), "exactly a distribution in float32"
    assert (qq - q).abs().max() <= 1.0 / Q_SCALE
    counts = wire_counts(qq)
    assert counts.dtype.name == "uint16" and counts.nbytes == 6 * 16384 * 2
    assert torch.equal(from_wire(counts), qq), "the verifier gets the very q sampled from"
    assert (qq > 0).sum() < (q > 0).sum(), "the far tail rounds to 0"
    one_hot = torch.zeros(1, 10)
    one_hot[0, 3] = 1.0
    assert torch.equal(quantize_distribution(one_hot), one_hot)


def test_unpack_counts_places_q_in_the_vocabulary():
    from vllm_saguaro.core.sampling import quantize_distribution, unpack_counts, wire_counts

    q1 = quantize_distribution(torch.softmax(torch.randn(3, 4), -1))
    q2 = quantize_distribution(torch.softmax(torch.randn(2, 4), -1))
    head = torch.tensor([1, 4, 5, 9])
    out = unpack_counts([wire_counts(q1), wire_counts(q2)], head, 10)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out[0][:, head], q1) and torch.equal(out[1, :2][:, head], q2)
    assert out[1, 2].sum() == 0 and out[:, :, [0, 2, 3, 6, 7, 8]].sum() == 0
    assert torch.equal(unpack_counts([wire_counts(q1)], None, 4)[0], q1)
