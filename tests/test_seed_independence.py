"""Seeds that sample together never mix: each seed draws, is rewarded and learns as its solo run does.

The oracle of every test is the seed's solo run: its own model and generator (the sampler), or the
single-seed trainer with that seed and a fresh reward object of its own. The seeds' completions end
at different steps (a hot temperature and a long budget), the comparison runs over several
successive calls or steps, the rewards are stateful (a seeded coin, a noisy rater, a count of earlier
calls), and the same seed is batched beside different seeds, in different orders and numbers.
"""
import copy

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import AdditionTask, PreferenceTask
from rlcourse.lm import load_checkpoint, sample
from rlcourse.trainers.online_dpo import BradleyTerryRater, OnlineDPOConfig, OnlineDPOTrainer
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.lm.seed_stack import stack_models
from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
from rlcourse.trainers.ppo_rlhf_seeds import SeedBatchedPPORLHFTrainer
from rlcourse.tasks.verifiers import RandomReward, RewardedTask
from seed_helpers import perturbed_copies


@pytest.fixture(scope="module")
def addition():
    return load_checkpoint("addition-partial", device="cpu")


class CountingReward:
    """A stateful reward: ``task.reward`` + 0.1 x the number of earlier calls + a seeded uniform draw.

    ``seen`` records the completions of every call, so a test can compare what each run drew.
    """

    __name__ = "counting_reward"

    def __init__(self, task, seed: int = 0):
        self.task, self.calls, self.seen, self.rng = task, 0, [], np.random.default_rng(seed)

    def __call__(self, prompts, completions, **kwargs):
        self.seen.append(list(completions))
        base = np.asarray(torch.as_tensor(self.task.reward(prompts, completions)), dtype=float)
        out = base + 0.1 * self.calls + self.rng.random(len(completions))
        self.calls += 1
        return out.tolist()


def _end_steps_differ(seen_by_seed) -> bool:
    """Some step in which the seeds' longest completions differ (the char tokenizer: a character, a token)."""
    return any(len({max(map(len, step)) for step in steps}) > 1 for steps in zip(*seen_by_seed))


# --- the sampler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["lean", "static"])
def test_each_seeds_stream_advances_as_its_solo_runs_over_successive_calls(addition, engine):
    """Four calls with the same generators: a seed whose rows end early must not draw while others go on."""
    model, tok = addition
    task, seeds, calls = AdditionTask(), [0, 1, 2], 4
    models = perturbed_copies(model, seeds)
    prompts = [[task.prompts(4, np.random.default_rng(100 * c + s)) for s in seeds] for c in range(calls)]
    solo = {s: [] for s in seeds}
    for s in seeds:
        g = torch.Generator().manual_seed(10 + s)
        solo[s] = [sample(models[s], tok, prompts[c][s], 10, temperature=1.5, generator=g, engine=engine)
                   for c in range(calls)]
    for order in ([0, 1, 2], [2, 0], [1]):
        stack = stack_models([models[s] for s in order])
        gens = [torch.Generator().manual_seed(10 + s) for s in order]
        for c in range(calls):
            together = sample(stack, tok, [p for s in order for p in prompts[c][s]], 10, temperature=1.5,
                              generator=gens, engine=engine)
            for i, s in enumerate(order):
                mine, alone = together.select(slice(4 * i, 4 * i + 4)), solo[s][c]
                n = alone.completion_ids.shape[1]
                assert mine.completions == alone.completions, (order, c, s)
                assert torch.equal(mine.completion_ids[:, :n], alone.completion_ids)
                assert not mine.completion_mask[:, n:].any()
                assert float((mine.logprobs[:, :n] - alone.logprobs).abs().max()) < 1e-5
    ends = [[roll.completion_mask.shape[1] for roll in solo[s]] for s in seeds]
    assert any(len(set(column)) > 1 for column in zip(*ends)), ends     # the seeds ended at different steps


# --- the critic-free trainers ------------------------------------------------------------------------

PG = dict(per_device_train_batch_size=8, num_generations=4, loss_type="grpo", learning_rate=1e-4,
          max_completion_length=10, temperature=1.5)


def _pg_task(coin: int = 3):
    addition = AdditionTask()
    return RewardedTask(addition, [CountingReward(addition, seed=7), RandomReward(0.5, seed=coin)])


def _pg_solo(model, tok, seed: int, coin: int = 3, steps: int = 3, **config):
    task = _pg_task(coin)
    trainer = PolicyGradientTrainer(copy.deepcopy(model), tok, task, PolicyGradientConfig(seed=seed, **{**PG, **config}))
    trainer.train(steps, progress=False)
    return trainer, task.reward_funcs[0].seen


def test_a_batched_seed_draws_and_is_rewarded_as_its_solo_run(addition):
    """Seed s beside other seeds, in any order or number, with one task copied per seed or a list of
    tasks: the same completions, the same stateful rewards and the same metrics as its solo run."""
    model, tok = addition
    steps = 3
    solo = {(s, coin): _pg_solo(model, tok, s, coin, steps) for s, coin in ((0, 3), (1, 3), (2, 3), (2, 5))}
    for seeds, task in (([0, 1, 2], _pg_task()), ([2, 0], _pg_task()), ([2, 1], [_pg_task(5), _pg_task(3)])):
        batched = SeedBatchedPolicyGradientTrainer(model, tok, task, PolicyGradientConfig(**PG), seeds=seeds)
        batched.train(steps, progress=False)
        coins = [5, 3] if isinstance(task, list) else [3] * len(seeds)
        for i, (s, coin) in enumerate(zip(seeds, coins)):
            alone, alone_seen = solo[s, coin]
            for step, (mine, theirs) in enumerate(zip(batched.history[i], alone.history)):
                for key in ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio"):
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (seeds, s, step, key)
                assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3, abs=1e-6), (seeds, s, step)
            assert batched.tasks[i].reward_funcs[0].seen == alone_seen, (seeds, s)
        assert _end_steps_differ([batched.tasks[i].reward_funcs[0].seen for i in range(len(seeds))])
        if not isinstance(task, list):
            assert task.reward_funcs[0].calls == 0        # the given task is each seed's start, never called


def test_the_moving_average_baseline_skips_what_the_single_seed_trainer_skips(addition):
    """With truncated completions masked and a 3-token budget, a seed whose prompt sums past 99 has
    every token masked: that step is skipped, and its baseline must not move (the solo run never
    computes its advantages)."""
    model, tok = addition
    config = dict(advantage_estimator="moving_average", loss_type="dapo", mask_truncated_completions=True,
                  max_completion_length=3, temperature=1.0, per_device_train_batch_size=4, num_generations=4)
    steps, seeds = 6, [0, 1, 2, 3]
    batched = SeedBatchedPolicyGradientTrainer(model, tok, _pg_task(), PolicyGradientConfig(**{**PG, **config}),
                                               seeds=seeds)
    baselines = []
    batched.train(steps, progress=False, callback=lambda i, t: baselines.append(list(t.baselines)))
    skipped = 0
    for i, s in enumerate(seeds):
        alone = PolicyGradientTrainer(copy.deepcopy(model), tok, _pg_task(),
                                      PolicyGradientConfig(seed=s, **{**PG, **config}))
        for step in range(steps):
            alone.step()
            mine = baselines[step][i]
            assert (mine is None) == (alone.baseline is None), (s, step, mine, alone.baseline)
            assert alone.baseline is None or mine == pytest.approx(alone.baseline, rel=1e-6), (s, step)
        assert [m.get("skipped", 0.0) for m in batched.history[i]] == [m.get("skipped", 0.0) for m in alone.history]
        for mine, theirs in zip(batched.history[i], alone.history):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3, abs=1e-6), s
        skipped += sum(m.get("skipped", 0.0) for m in alone.history[1:])
    assert skipped > 0                                    # a step skipped after the first: the case tested


# --- PPO-RLHF ----------------------------------------------------------------------------------------

def _ppo_config(seed: int) -> PPOConfig:
    return PPOConfig(learning_rate=3e-4, batch_size=8, num_ppo_epochs=1, num_mini_batches=2, response_length=10,
                     temperature=1.5, kl_coef=0.05, seed=seed)


def test_a_batched_ppo_seed_draws_and_is_rewarded_as_its_solo_run(addition):
    model, tok = addition
    task, steps = AdditionTask(), 3
    critic = ScalarHeadModel(model, head_std=0.1)
    solo = {}
    for s in (3, 4, 5):
        reward, gold = CountingReward(task, seed=1), CountingReward(task, seed=2)
        t = PPORLHFTrainer(_ppo_config(s), copy.deepcopy(model), tok, reward, copy.deepcopy(critic), task.prompts,
                           gold_fn=gold)
        t.train(steps, progress=False)
        solo[s] = (t.history, reward.seen, gold.seen)
    for seeds in ([3, 4, 5], [5, 3]):
        reward, gold = CountingReward(task, seed=1), CountingReward(task, seed=2)
        batched = SeedBatchedPPORLHFTrainer(_ppo_config(seeds[0]), model, tok, reward, critic, task.prompts,
                                            gold_fn=gold, seeds=seeds)
        batched.train(steps, progress=False)
        for i, s in enumerate(seeds):
            history, seen, gold_seen = solo[s]
            for step, (mine, theirs) in enumerate(zip(batched.history[i], history)):
                for key in ("objective/scores", "gold/scores", "val/num_eos_tokens"):
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-6), (seeds, s, step, key)
                for key in ("objective/kl", "loss/policy_avg", "loss/value_avg"):    # the same updates, to rounding
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-5), (seeds, s, step, key)
            assert batched.seed_rewards[i].seen == seen, (seeds, s)
            assert batched.seed_golds[i].seen == gold_seen == seen, (seeds, s)
        assert _end_steps_differ([batched.seed_rewards[i].seen for i in range(len(seeds))])
        assert reward.calls == 0 and gold.calls == 0


# --- online DPO --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def preference():
    return load_checkpoint("preference-sft", device="cpu")


def _online_args(seed: int = 0) -> OnlineDPOConfig:
    return OnlineDPOConfig(beta=0.5, learning_rate=1e-3, per_device_train_batch_size=3, max_steps=3,
                           temperature=1.5, seed=seed)


def test_a_batched_online_dpo_seed_draws_and_is_rated_as_its_solo_run(preference):
    """A noisy rater (its own Gumbel stream) and a counting gold function, copied per seed."""
    model, tok = preference
    task = PreferenceTask()
    solo = {}
    for s in (0, 1, 2):
        rater, gold = BradleyTerryRater(task.rater_utility, 1.0, seed=9), CountingReward(task, seed=2)
        t = OnlineDPOTrainer(copy.deepcopy(model), tok, rater, task.prompts, _online_args(s), gold_fn=gold)
        t.train(progress=False)
        solo[s] = (t.history[0], gold.seen)
    for seeds in ([0, 1, 2], [2, 0]):
        rater, gold = BradleyTerryRater(task.rater_utility, 1.0, seed=9), CountingReward(task, seed=2)
        batched = OnlineDPOTrainer(model, tok, rater, task.prompts, _online_args(), seeds=seeds, gold_fn=gold)
        batched.train(progress=False)
        for i, s in enumerate(seeds):
            history, seen = solo[s]
            for step, (mine, theirs) in enumerate(zip(batched.history[i], history)):
                assert mine["pairs"] == theirs["pairs"], (seeds, s, step)
                for key in ("objective/scores", "gold/scores", "val/contain_eos_token"):
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-6), (seeds, s, step, key)
            assert batched.seed_golds[i].seen == seen, (seeds, s)
        assert _end_steps_differ([batched.seed_golds[i].seen for i in range(len(seeds))])
        assert gold.calls == 0


def test_tasks_that_cannot_be_one_per_seed_are_named(addition):
    model, tok = addition
    config = PolicyGradientConfig(**PG)
    with pytest.raises(ValueError, match="one task per seed \\(2\\), got 3 tasks"):
        SeedBatchedPolicyGradientTrainer(model, tok, [_pg_task()] * 3, config, seeds=[0, 1])
    short = AdditionTask(n_digits=1)
    with pytest.raises(ValueError, match="different completion budgets"):
        SeedBatchedPolicyGradientTrainer(model, tok, [AdditionTask(), short], PolicyGradientConfig(), seeds=[0, 1])

    class Unpicklable(AdditionTask):
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle this task")

    with pytest.raises(ValueError, match="task cannot be copied for each seed"):
        SeedBatchedPolicyGradientTrainer(model, tok, Unpicklable(), config, seeds=[0, 1])
