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
from rlcourse.lm.model import SIZES, count_parameters, make_model
from rlcourse.lm.sampling import Rollout, sample
from rlcourse.lm.sft import exact_match, train_sft
from rlcourse.lm.tasks import AdditionTask, DigitSumTask, PreferenceTask
from rlcourse.lm.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

__all__ = [
    "AdditionTask", "DEFAULT_ALPHABET", "DigitSumTask", "PreferenceTask", "Rollout", "SIZES",
    "available_checkpoints", "build_char_tokenizer", "checkpoint_info", "count_parameters",
    "exact_match", "load_checkpoint", "make_model", "next_token_logprobs", "position_ids_from_mask",
    "sample", "save_checkpoint", "sequence_logprobs", "token_logprobs_from_logits", "train_sft",
]

# Lessons 09-10: the critic-free policy-gradient trainer and the enumerable policy (exact oracle).
from rlcourse.lm.exact_oracle import EnumerablePolicy  # noqa: E402
from rlcourse.lm.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer  # noqa: E402

__all__ += ["EnumerablePolicy", "PolicyGradientConfig", "PolicyGradientTrainer"]
