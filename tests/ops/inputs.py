"""Random rows for the sampling op's checks (Triton and CUDA against the reference)."""
import torch


def sampling_rows(gen, R, V, ties=False, edges=False):
    """logits, temperature, top_k, top_p, fanout, seeds for R rows of V tokens: top-k off
    (0) and 1, nuclei of a token or two (cutting into the top F), F = 0; ties: few distinct
    logits (every threshold inside a group of equal ones, signed zeros); edges (R >= 7):
    top_k >= V, F + 1 > V, F < 0 (clamped to 0 by the reference, as by the CUDA op)."""
    logits = torch.randn(R, V, generator=gen) * 4
    if ties:
        logits = torch.round(logits)
    temperature = 0.3 + 1.5 * torch.rand(R, generator=gen)
    top_k = torch.randint(0, V + 2, (R,), generator=gen)
    top_k[::3] = 0
    top_k[1::5] = 1
    top_p = torch.where(torch.rand(R, generator=gen) < 0.5, 1.0,
                        0.05 + 0.9 * torch.rand(R, generator=gen))
    top_p[2::4] = 0.05
    fanout = torch.randint(0, 9, (R,), generator=gen)
    fanout[::4] = 0
    if edges:
        top_k[4] = V
        fanout[5] = V + 3
        fanout[6] = -1
    seeds = torch.randint(-2**62, 2**62, (R,), generator=gen)
    return logits, temperature, top_k, top_p, fanout, seeds
