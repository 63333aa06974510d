"""A tiny GPT as a policy: tokenizer, model factory, tasks with verifiers, sampler, log-probs, SFT.

    from rlcourse.lm import load_checkpoint, sample, sequence_logprobs, AdditionTask
    model, tokenizer = load_checkpoint("addition-partial")
    task = AdditionTask()
    rollout = sample(model, tokenizer, task.prompts(8, rng=0), task.max_new_tokens)
    rewards = task.reward(rollout.prompts, rollout.completions)
"""
from rlcourse.lm.checkpoints import (available_checkpoints, checkpoint_info, load_checkpoint,
                                     save_checkpoint)
from rlcourse.lm.logprobs import (next_token_logprobs, position_ids_from_mask, sequence_logprobs,
                                  token_logprobs_from_logits)
from rlcourse.lm.model import SIZES, count_parameters, frozen_copy, make_model
from rlcourse.lm.sampling import Rollout, sample
from rlcourse.lm.sft import exact_match, train_sft
from rlcourse.lm.tasks import AdditionTask, DigitSumTask, FillerAdditionTask, PreferenceTask
from rlcourse.lm.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

__all__ = [
    "AdditionTask", "DEFAULT_ALPHABET", "DigitSumTask", "FillerAdditionTask", "PreferenceTask", "Rollout", "SIZES",
    "available_checkpoints", "build_char_tokenizer", "checkpoint_info", "count_parameters",
    "exact_match", "frozen_copy", "load_checkpoint", "make_model", "next_token_logprobs", "position_ids_from_mask",
    "sample", "save_checkpoint", "sequence_logprobs", "token_logprobs_from_logits", "train_sft",
]

# Lessons 09-10: the critic-free policy-gradient trainer and the enumerable policy (exact oracle).
from rlcourse.lm.exact_oracle import EnumerablePolicy  # noqa: E402
from rlcourse.lm.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer  # noqa: E402

__all__ += ["EnumerablePolicy", "PolicyGradientConfig", "PolicyGradientTrainer"]

# Lesson 08: reward models, the critic, PPO-RLHF and best-of-n.
from rlcourse.lm.best_of_n import best_of_n, best_of_n_kl  # noqa: E402
from rlcourse.lm.ppo_rlhf import PPOConfig, PPORLHFTrainer  # noqa: E402
from rlcourse.lm.reward_model import ScalarHeadModel, score_completions, train_reward_model  # noqa: E402
from rlcourse.lm.value_model import make_value_model  # noqa: E402

__all__ += ["PPOConfig", "PPORLHFTrainer", "ScalarHeadModel", "best_of_n", "best_of_n_kl", "make_value_model",
            "score_completions", "train_reward_model"]

# Lesson 11: DPO.
from rlcourse.lm.dpo import DPOConfig, train_dpo  # noqa: E402

__all__ += ["DPOConfig", "train_dpo"]
