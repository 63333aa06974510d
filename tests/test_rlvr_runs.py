"""rlcourse.measure.rlvr_runs: a stacked model's draw equals each seed's own, and pass@k per seed equals the
share of k-subsets holding a right sample, counted by enumeration."""
import itertools

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import load_checkpoint
from rlcourse.measure.rlvr_runs import draw, pass_at_k_curve, per_seed_series
from rlcourse.lm.seed_stack import stack_models


@pytest.fixture(scope="module")
def two_models():
    first, tokenizer = load_checkpoint("addition-partial", device="cpu")
    second, _ = load_checkpoint("addition-partial", device="cpu")
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    return first, second, tokenizer


def test_a_stacked_draw_is_each_seeds_own_draw(two_models):
    first, second, tokenizer = two_models
    prompts, task = ["12+34=", "5+7=", "90+9="], AdditionTask()
    stacked = draw(stack_models([first, second]), tokenizer, prompts, 6, task.max_new_tokens, seed=3)
    alone = [draw(m, tokenizer, prompts, 6, task.max_new_tokens, seed=3) for m in (first, second)]
    assert stacked.shape == (2, 3, 6) and alone[0].shape == (1, 3, 6)
    for s in range(2):
        assert stacked.completions[s] == alone[s].completions[0]
        np.testing.assert_array_equal(stacked.lengths[s], alone[s].lengths[0])
        np.testing.assert_allclose(stacked.logprobs[s], alone[s].logprobs[0], atol=1e-4)
    assert stacked.completions[0] != stacked.completions[1]
    right = stacked.judge(task.reward)
    expected = [[[float(c == task.answer(p)) for c in row] for p, row in zip(prompts, seed)] for seed in stacked.completions]
    np.testing.assert_array_equal(right, expected)
    # one token per character, plus <eos> unless the completion was cut at max_new_tokens
    text_lengths = np.array([[[len(c) for c in row] for row in seed] for seed in stacked.completions])
    np.testing.assert_array_equal(stacked.lengths, text_lengths + ~stacked.truncated)
    assert bool((stacked.lengths[stacked.truncated] == task.max_new_tokens).all())


def test_judge_and_draw_refuse_bad_input(two_models):
    first, _, tokenizer = two_models
    sampled = draw(first, tokenizer, ["1+1="], 2, 3)
    with pytest.raises(ValueError, match="one value per completion"):
        sampled.judge(lambda prompts, completions: [1.0])
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        draw(first, tokenizer, "1+1=", 2, 3)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        draw(first, tokenizer, ["1+1="], 0, 3)


def test_pass_at_k_curve_counts_k_subsets():
    rng = np.random.default_rng(0)
    correct = rng.random((3, 5, 6)) < 0.3
    ks = [1, 2, 4, 6]
    got = pass_at_k_curve(correct, ks)
    for s, i in itertools.product(range(3), range(len(ks))):
        k = ks[i]
        per_prompt = [np.mean([row[list(subset)].any() for subset in itertools.combinations(range(6), k)])
                      for row in correct[s]]
        assert got[s, i] == pytest.approx(np.mean(per_prompt), abs=1e-12)
    with pytest.raises(ValueError, match=r"\(S, P, n\)"):
        pass_at_k_curve(correct[0], ks)


def test_per_seed_series_reads_a_metric_and_leaves_nan_where_it_is_missing():
    history = [[{"reward": 0.1}, {"reward": 0.3}], [{"reward": 0.2}, {}]]
    got = per_seed_series(history, "reward")
    assert got.shape == (2, 2) and got[0].tolist() == [0.1, 0.3] and got[1, 0] == 0.2 and np.isnan(got[1, 1])


def test_batch_drift_is_each_seeds_change_of_its_own_batch(two_models):
    """After one step with two updates per batch, batch_drift equals each seed's own model (copied out of the
    stack) scored on its rows of the batch, minus the log-probs the batch was sampled with, averaged by group."""
    from rlcourse.lm.logprobs import sequence_logprobs
    from rlcourse.measure.rlvr_runs import DRIFT_GROUPS, batch_drift
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
    first, _, tokenizer = two_models
    config = PolicyGradientConfig(per_device_train_batch_size=32, num_generations=8, num_iterations=2, learning_rate=3e-4)
    trainer = SeedBatchedPolicyGradientTrainer(first, tokenizer, AdditionTask(), config, num_seeds=2)
    with pytest.raises(ValueError, match="num_iterations > 1"):
        batch_drift(trainer)
    trainer.step()
    got = batch_drift(trainer, rare_below=0.5, likely_above=0.5)
    assert got.shape == (2, len(DRIFT_GROUPS))
    b = trainer.last_batch
    for s in range(2):
        rows = slice(32 * s, 32 * (s + 1))
        with torch.no_grad():
            new = sequence_logprobs(trainer.model_of(s), b.prompt_ids[rows], b.completion_ids[rows],
                                    b.loss_mask[rows], b.prompt_mask[rows]).double()
        old, mask, adv = b.old_logprobs[rows].double(), b.loss_mask[rows].bool(), b.advantages[rows]
        p = old.exp()
        groups = [mask & (p >= 0.5), mask & (p < 0.5) & (adv[:, None] > 0), mask & (p < 0.5) & (adv[:, None] < 0)]
        for j, keep in enumerate(groups):
            assert bool(keep.any()), (s, j)
            assert got[s, j] == pytest.approx(float((new - old)[keep].mean()), abs=1e-4), (s, j)
    assert np.all(np.abs(got) > 1e-4)                          # the step moved every group
    with pytest.raises(ValueError, match="rare_below <= likely_above"):
        batch_drift(trainer, rare_below=0.7, likely_above=0.5)
