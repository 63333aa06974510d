"""rlcourse.measure.length_bias: the exact wrong-answer length it tracks, and the bias it shows."""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.measure.exact_gradient import EnumerablePolicy
from rlcourse.measure.length_bias import wrong_answer_lengths


def test_the_tracked_length_is_the_exact_expectation_over_every_completion():
    # With a learning rate of ~0 the policy stays where it started: every value is its start's,
    # computed here by a plain loop over the 127 completions.
    policy = EnumerablePolicy(vocab_size=3, max_len=6, seed=4, init_scale=0.5)
    with torch.no_grad():
        p = policy.probs()[0].tolist()
    words = [tuple(int(t) for t in row[:int(n)]) for row, n in zip(policy.completions, policy.lengths)]
    wrong = [i for i, w in enumerate(words) if w[:2] != (1, 0)]
    exact = sum(p[i] * len(words[i]) for i in wrong) / sum(p[i] for i in wrong)
    lengths = wrong_answer_lengths("grpo", seed=4, steps=3, lr=1e-12)
    assert len(lengths) == 3
    assert np.allclose(lengths, exact, atol=1e-6)


def test_wrong_answers_grow_under_the_sequence_mean_only():
    final = {lt: np.mean([wrong_answer_lengths(lt, s)[-1] for s in (0, 1)]) for lt in ("grpo", "dapo", "dr_grpo")}
    assert final["grpo"] > final["dr_grpo"] + 0.5 and final["grpo"] > final["dapo"] + 0.5
