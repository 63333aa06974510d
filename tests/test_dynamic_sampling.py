"""DAPO's dynamic sampling refills the batch: with a stub task whose informative groups are known in
advance, the trainer keeps exactly those groups, fills exactly a full batch, respects the cap,
reports ``num_gen_batches``, skips a step with no signal, and the KL-in-reward, reference and
truncation-mask paths work on a batch assembled from several generation batches."""
import copy

import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.lm import load_checkpoint, sequence_logprobs
from rlcourse.trainers.dynamic_sampling import fill_batch, informative_groups
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer

K = 4


class CountingTask:
    """Prompt ``j`` is ``"j+0="`` with ``j`` counting up across calls, so each group is identified by
    its prompt. Group ``j`` is informative iff ``informative(j)``: its rewards alternate 0, 1, 0, 1;
    any other group's rewards are all 1."""

    max_new_tokens = 3

    def __init__(self, informative):
        self.informative, self.next, self.calls = informative, 0, 0

    def prompts(self, n, rng=None):
        self.calls += 1
        out = [f"{self.next + i}+0=" for i in range(n)]
        self.next += n
        return out

    @staticmethod
    def number(prompt):
        return int(prompt.split("+")[0])

    def reward(self, prompts, completions):
        # completions of one group are adjacent and K is even, so i % 2 alternates inside every group
        return torch.tensor([float(i % 2) if self.informative(self.number(p)) else 1.0
                             for i, p in enumerate(prompts)])


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _trainer(checkpoint, task, ref_model=None, **kw):
    model = copy.deepcopy(checkpoint[0]).eval()
    kw = {"per_device_train_batch_size": 16, "num_generations": K, "dynamic_sampling": True, **kw}
    return PolicyGradientTrainer(model, checkpoint[1], task, PolicyGradientConfig(**kw), ref_model=ref_model)


def _kept_groups(tokenizer, batch):
    texts = tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
    numbers = [CountingTask.number(t) for t in texts]
    assert all(numbers[g * K:(g + 1) * K] == [numbers[g * K]] * K for g in range(len(numbers) // K))
    return numbers[::K]


def test_the_batch_is_refilled_with_exactly_the_informative_groups(checkpoint):
    task = CountingTask(lambda j: j % 3 == 0)          # draws {0..3}, {4..7}, {8..11}: 2 + 1 + 1 groups
    trainer = _trainer(checkpoint, task, max_num_gen_batches=4)
    batch = trainer.make_batch()
    assert batch.completion_ids.shape[0] == 16 and _kept_groups(checkpoint[1], batch) == [0, 3, 6, 9]
    assert task.calls == 3 and batch.metrics["num_gen_batches"] == 3
    assert batch.metrics["frac_reward_zero_std"] == pytest.approx(8 / 12)   # over every group drawn
    assert batch.metrics["reward"] == pytest.approx((8 * 4 + 4 * 2) / 48)
    assert bool((batch.advantages.view(-1, K).abs().sum(1) > 0).all())


def test_extra_groups_of_the_last_draw_are_left_out(checkpoint):
    task = CountingTask(lambda j: j % 4 != 3)          # 3 informative groups per draw
    trainer = _trainer(checkpoint, task)
    batch = trainer.make_batch()
    assert _kept_groups(checkpoint[1], batch) == [0, 1, 2, 4] and batch.loss_mask.shape[0] == 16
    assert batch.metrics["num_gen_batches"] == 2 and batch.metrics["frac_reward_zero_std"] == pytest.approx(2 / 8)


def test_the_cap_is_respected_and_what_was_collected_is_trained_on(checkpoint):
    task = CountingTask(lambda j: j % 8 == 0)          # 12 prompts drawn under the cap: groups 0 and 8
    trainer = _trainer(checkpoint, task, max_num_gen_batches=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step()
    assert task.calls == 3 and metrics["num_gen_batches"] == 3 and "skipped" not in metrics
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    task.next = 0
    batch = _trainer(checkpoint, task, max_num_gen_batches=3).make_batch()
    assert _kept_groups(checkpoint[1], batch) == [0, 8] and batch.advantages.shape == (8,)


def test_without_refill_a_cap_of_one_only_drops(checkpoint):
    task = CountingTask(lambda j: j % 2 == 0)
    batch = _trainer(checkpoint, task, max_num_gen_batches=1).make_batch()
    assert _kept_groups(checkpoint[1], batch) == [0, 2] and task.calls == 1


def test_a_step_with_no_signal_in_any_draw_is_skipped_after_the_cap(checkpoint):
    task = CountingTask(lambda j: False)
    trainer = _trainer(checkpoint, task, max_num_gen_batches=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step()
    assert metrics["skipped"] == 1.0 and metrics["loss"] == 0.0 and metrics["num_gen_batches"] == 3
    assert metrics["frac_reward_zero_std"] == 1.0 and task.calls == 3
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_without_dynamic_sampling_one_batch_is_drawn_and_kept(checkpoint):
    task = CountingTask(lambda j: j % 2 == 0)
    batch = _trainer(checkpoint, task, dynamic_sampling=False).make_batch()
    assert _kept_groups(checkpoint[1], batch) == [0, 1, 2, 3]
    assert batch.metrics["num_gen_batches"] == 1 and batch.metrics["frac_reward_zero_std"] == 0.5


def test_kl_in_reward_reference_and_truncation_masks_on_a_refilled_batch(checkpoint):
    """Groups 1, 4, 7, 10 come from three draws of different widths ("10+0=" is one column wider);
    every number is recomputed row by row, without padding, and must match the batched one."""
    task = CountingTask(lambda j: j % 3 == 1)
    ref = copy.deepcopy(checkpoint[0]).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    beta = 0.1
    trainer = _trainer(checkpoint, task, ref_model=ref, advantage_estimator="rloo", loss_type="rloo",
                       kl_in_reward=True, beta=beta, mask_truncated_completions=True, max_completion_length=2,
                       num_iterations=2)
    b = trainer.make_batch()
    assert _kept_groups(checkpoint[1], b) == [1, 4, 7, 10] and b.metrics["num_gen_batches"] == 3
    assert b.ref_logprobs.shape == b.completion_ids.shape == b.old_logprobs.shape == b.loss_mask.shape
    ended = (b.completion_ids == trainer.tokenizer.eos_token_id).any(1)
    assert bool((b.loss_mask[~ended] == 0).all()) and bool((b.loss_mask[ended].sum(1) > 0).all())
    assert bool((~ended).any()) and bool(ended.any())

    shaped = []
    for i in range(b.completion_ids.shape[0]):
        prompt = b.prompt_ids[i][b.prompt_mask[i].bool()][None]
        args = (prompt, b.completion_ids[i:i + 1], b.loss_mask[i:i + 1])
        with torch.no_grad():
            logp, ref_logp = sequence_logprobs(trainer.model, *args), sequence_logprobs(ref, *args)
        assert torch.allclose(b.old_logprobs[i], logp[0], atol=1e-5)
        assert torch.allclose(b.ref_logprobs[i], ref_logp[0], atol=1e-5)
        reward = float(i % 2)                              # every kept group is informative: 0, 1, 0, 1
        shaped.append(reward - beta * float((logp - ref_logp).sum()))
    shaped = torch.tensor(shaped).view(-1, K)
    leave_one_out = shaped - (shaped.sum(1, keepdim=True) - shaped) / (K - 1)
    assert torch.allclose(b.advantages, leave_one_out.flatten(), atol=1e-5)
    assert (shaped - torch.tensor([0.0, 1.0, 0.0, 1.0])).abs().max() > 1e-3   # the KL really entered the rewards
    metrics = trainer.step()
    assert metrics["num_gen_batches"] >= 1 and torch.isfinite(torch.tensor(metrics["loss"]))


def _ragged_lengths(monkeypatch):
    """The sampler with completion lengths 1, 2, 3, 1, 2, 3, ... row by row: every group holds different lengths."""
    import rlcourse.trainers.policy_gradient as pg
    real = pg.sample

    def ragged(*args, **kwargs):
        roll = real(*args, **kwargs)
        lengths = torch.arange(roll.completion_mask.shape[0]) % 3 + 1
        roll.completion_mask = (torch.arange(roll.completion_mask.shape[1])[None] < lengths[:, None]).long()
        return roll
    monkeypatch.setattr(pg, "sample", ragged)


def test_dynamic_sampling_filters_on_the_task_reward_not_the_overlong_shaped_one(checkpoint, monkeypatch):
    """With DAPO's overlong penalty on, a group of equal task rewards but different lengths has unequal shaped
    rewards; it still has nothing to learn about the task and is dropped (verl's DAPO filters on accuracy).
    The kept groups train on the shaped rewards."""
    _ragged_lengths(monkeypatch)
    shaping = dict(max_completion_length=3, overlong_buffer_len=3)       # every token costs 1/3
    task = CountingTask(lambda j: False)                                 # no group differs in task reward
    metrics = _trainer(checkpoint, task, max_num_gen_batches=2, **shaping).step()
    assert metrics.get("skipped") == 1.0 and metrics["num_gen_batches"] == 2
    task = CountingTask(lambda j: j % 2 == 0)
    b = _trainer(checkpoint, task, max_num_gen_batches=2, **shaping).make_batch()
    assert _kept_groups(checkpoint[1], b) == [0, 2, 4, 6]
    lengths = b.loss_mask.sum(1).float()
    torch.testing.assert_close(b.rewards, torch.tensor([0.0, 1.0, 0.0, 1.0] * 4) - lengths / 3)


@pytest.mark.parametrize("bad", [0, -1, None, 2.5, True, "4"])
def test_bad_max_num_gen_batches_is_refused(bad):
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        PolicyGradientConfig(dynamic_sampling=True, max_num_gen_batches=bad)
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        fill_batch(lambda: None, 2, K, bad, 0)


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ValueError, match="num_generations"):
        PolicyGradientConfig(dynamic_sampling=True, num_generations=1, advantage_estimator="batch_mean")


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5 + 1e-7])
    assert informative_groups(rewards, K).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="num_generations"):
        informative_groups(rewards[:5], K)
