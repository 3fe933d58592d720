"""The sampler's draw (``kvserve.engine.layers.sampler.draw``, inverse-CDF sampling): its frequencies
follow the given probabilities, zero-probability tokens never come out, a seeded generator
repeats its draws, and NaN or all-zero rows raise as ``torch.multinomial`` does."""

import pytest
import torch

from kvserve.engine.layers.sampler import draw


def test_frequencies_follow_the_probabilities():
    g = torch.Generator().manual_seed(1234)  # seeded: the same draws on every run
    probs = torch.tensor([0.05, 0.0, 0.25, 0.0, 0.5, 0.2, 0.0]) * 3.0  # unnormalised is fine
    n = 40_000
    counts = torch.bincount(draw(probs.expand(n, -1).contiguous(), g), minlength=7).double()
    p = probs / probs.sum()
    sigma = (n * p * (1 - p)).sqrt()
    assert (counts[p == 0] == 0).all()  # a zero-probability token is never drawn
    assert ((counts - n * p).abs() <= 5 * sigma + 1e-9).all(), counts


def test_large_vocabulary_rows_and_a_peaked_row():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 49152, generator=g)
    logits[3] = -1e4
    logits[3, 123] = 0.0  # all the mass on one token
    got = draw(logits.softmax(-1), g)
    assert got.shape == (4,) and got.dtype == torch.int64 and got[3] == 123
    assert (0 <= got).all() and (got < 49152).all()


def test_seeded_draws_repeat_and_bad_rows_raise():
    probs = torch.rand(3, 1000)
    a = draw(probs, torch.Generator().manual_seed(5))
    b = draw(probs, torch.Generator().manual_seed(5))
    assert a.tolist() == b.tolist()
    with pytest.raises(RuntimeError):
        draw(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(RuntimeError):
        draw(torch.zeros(1, 5))
