"""core/verification.py: speculative rejection sampling with the recovered token drawn
only where it is kept. The first token a request keeps must be distributed as the
target's p, whatever q was (chi-square, rejected at p < 1e-4); greedy requests keep
the target's argmax run exactly."""
import pytest
import torch

from tests.stats import chi_square_pvalue
from vllm_saguaro.core import verification
from vllm_saguaro.core.verification import recovered_tokens, verify_drafts

ALPHA = 1e-4
V = 6
P0 = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])  # the target at the first position
Q0 = torch.tensor([0.1, 0.5, 0.05, 0.05, 0.2, 0.1])   # what the draft sampled from


def first_tokens(n: int, q: torch.Tensor | None, drafts: int = 2, seed: int = 0):
    """Verify n requests of `drafts` tokens each, the first drawn from q (one-hot on token
    1 where q is None), against P0 then a flat p; the first token each keeps."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x0 = (torch.multinomial(q, n, replacement=True, generator=gen) if q is not None
          else torch.ones(n, dtype=torch.long))
    ids = torch.stack([x0, torch.randint(0, V, (n,), generator=gen)], 1)[:, :drafts]
    logits = torch.stack([P0.log(), torch.zeros(V)]).repeat(n, 1, 1)[:, :drafts]
    probs = None
    if q is not None:
        probs = torch.stack([q, torch.full((V,), 1.0 / V)]).repeat(n, 1, 1)[:, :drafts]
        probs = probs.reshape(-1, V)
    out = verify_drafts(ids.reshape(-1), [drafts] * n, probs, logits.reshape(-1, V),
                        torch.randint(0, V, (n, 1), generator=gen), None,
                        torch.rand(n * drafts, dtype=torch.float64, generator=gen))
    return out[:, 0]


def chi_square(tokens: torch.Tensor, p: torch.Tensor):
    """(statistic, dof, p-value) of the tokens' counts against the distribution p [V]."""
    counts = {(int(t), 0): int(c) for t, c in enumerate(torch.bincount(tokens, minlength=V))}
    return chi_square_pvalue(counts, p[:, None].double(), len(tokens))


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor, label: str):
    stat, dof, pv = chi_square(tokens, p)
    assert pv > ALPHA, f"{label}: chi2={stat:.1f} dof={dof} p={pv:.3g}"


@pytest.mark.parametrize("q", [Q0, None], ids=["drawn_from_q", "one_hot_lookup"])
def test_the_first_token_kept_is_distributed_as_the_target(q):
    assert_distributed_as(first_tokens(40000, q), P0, "first token")


def test_a_recovered_token_drawn_from_p_instead_of_the_residual_is_caught(monkeypatch):
    """Power: the same test rejects a verifier that draws the recovered token from p."""
    real = verification.recovered_tokens
    monkeypatch.setattr(verification, "recovered_tokens",
                        lambda probs, q, drafted, generator=None, rows=None:
                        real(probs, torch.zeros_like(probs), drafted, generator, rows))
    assert chi_square(first_tokens(40000, Q0), P0)[2] < ALPHA


def test_recovered_tokens_follow_the_residual_and_never_the_drafted_one_hot():
    n = 30000
    probs = P0.repeat(n, 1)
    gen = torch.Generator().manual_seed(1)
    got = recovered_tokens(probs, Q0.repeat(n, 1), torch.zeros(n, dtype=torch.long), gen)
    residual = (P0 - Q0).clamp(min=0)
    assert_distributed_as(got, residual / residual.sum(), "residual of a dense q")
    got = recovered_tokens(probs, None, torch.full((n,), 2), gen)
    assert (got != 2).all()
    rest = P0.clone()
    rest[2] = 0
    assert_distributed_as(got, rest / rest.sum(), "p without the lookup token")
    # a padded draft (-1) takes nothing out
    got = recovered_tokens(probs, None, torch.full((n,), -1), gen)
    assert_distributed_as(got, P0, "p, padded draft")


def test_greedy_requests_keep_the_argmax_run_and_sampled_ones_the_bonus_when_all_pass():
    logits = torch.full((5, V), -5.0)
    argmax = [3, 1, 4, 0, 2]
    logits[torch.arange(5), argmax] = 5.0
    # request 0 greedy: drafts 3, 1, 0 -> keeps 3, 1 then the argmax 4 at the miss
    # request 1 sampled: two drafts with q = p (one-hot-ish p, q equal): both pass + bonus
    ids = torch.tensor([3, 1, 0, 0, 2])
    q = torch.softmax(logits, -1)
    out = verify_drafts(ids, [3, 2], q, logits, torch.tensor([[5], [5]]),
                        torch.tensor([True, False]), torch.zeros(5, dtype=torch.float64))
    assert out.dtype == torch.int32
    assert out.tolist() == [[3, 1, 4, -1], [0, 2, 5, -1]]


def test_padding_empty_rows_and_a_draft_the_draft_gave_no_mass():
    logits = torch.zeros(3, V)
    q = torch.full((3, V), 1.0 / V)
    q[2, 4] = 0.0  # request 2's token has no mass under q: rejected (vLLM's kernel too)
    out = verify_drafts(torch.tensor([-1, 1, 4]), [1, 0, 1, 1], q, logits,
                        torch.tensor([[7], [8], [9], [6]]), None,
                        torch.zeros(3, dtype=torch.float64))
    assert out[1].tolist() == [8, -1]       # no drafts: the bonus
    assert out[2].tolist() == [1, 9]        # u = 0 passes: token, then the bonus
    assert 0 <= out[0, 0] < V and out[0, 1] == -1  # padding rejected, a token in its place
    assert out[3].tolist() == [4, -1]  # rejected: the residual's only mass is token 4
