"""Sampling: the right distribution, the nucleus only, and draws that depend on no batch."""

import numpy as np
import torch

from engine.sampler import sampler

DRAWS = 40_000


def frequencies(sampler, logits_row, vocab):
    """Draw DRAWS tokens from one row of logits, each at its own (sequence, position)."""
    logits = logits_row.expand(DRAWS, vocab)
    sequences = torch.arange(DRAWS) % 97
    positions = torch.arange(DRAWS) // 97
    picked = sampler(logits, sequences, positions)
    return np.bincount(picked.numpy(), minlength=vocab) / DRAWS


def test_greedy_takes_the_most_likely_token():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(5)
    assert sampler()(logits, ids, ids).tolist() == logits.argmax(-1).tolist()


def test_sampled_tokens_follow_the_softmax_of_logits_over_temperature():
    vocab, temperature = 12, 0.7
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2
    expected = torch.softmax(logits.double()[0] / temperature, -1).numpy()  # float64 reference
    seen = frequencies(sampler(temperature, 1.0, seed=3), logits, vocab)
    # Binomial spread: 4 standard deviations of the largest probability's frequency.
    assert np.abs(seen - expected).max() < 4 * np.sqrt(0.25 / DRAWS)


def test_top_p_samples_only_the_nucleus_renormalised():
    vocab, top_p = 10, 0.8
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -1.5, -2.0, -3.0]])
    probs = torch.softmax(logits.double()[0], -1).numpy()
    order = np.argsort(-probs)
    # The smallest set of most likely tokens whose mass reaches top_p, computed independently.
    size = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
    nucleus = order[:size]
    expected = np.zeros(vocab)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    seen = frequencies(sampler(1.0, top_p, seed=4), logits, vocab)
    assert (seen[order[size:]] == 0).all(), "a token outside the nucleus"
    assert np.abs(seen - expected).max() < 4 * np.sqrt(0.25 / DRAWS)


def test_a_draw_depends_on_the_seed_sequence_and_position_not_on_the_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=g)
    sequences, positions = torch.tensor([4, 9, 2, 7, 0, 5]), torch.tensor([3, 3, 80, 1, 0, 12])
    drawing = sampler(1.0, 0.95, seed=11)
    together = drawing(logits, sequences, positions)
    shuffled = torch.tensor([5, 0, 3, 1, 4, 2])
    assert drawing(logits[shuffled], sequences[shuffled], positions[shuffled]).tolist() == \
        together[shuffled].tolist()
    alone = [drawing(logits[i:i + 1], sequences[i:i + 1], positions[i:i + 1]).item() for i in range(6)]
    assert alone == together.tolist()
    assert sampler(1.0, 0.95, seed=12)(logits, sequences, positions).tolist() != together.tolist()
