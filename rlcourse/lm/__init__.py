"""The language-model substrate: a tiny GPT as a policy, and what every trainer does with it.

Tokenizer (:mod:`~rlcourse.lm.tokenizer`), model factory (:mod:`~rlcourse.lm.model`), the shipped
checkpoints (:mod:`~rlcourse.lm.checkpoints`), the lean GPT-2 forward (:mod:`~rlcourse.lm.fast_gpt2`),
the sampler (:mod:`~rlcourse.lm.sampling`), log-probs and masks (:mod:`~rlcourse.lm.logprobs`),
samplers that compute differently from the trainer (:mod:`~rlcourse.lm.off_policy_samplers`,
lesson 10c), a body with a scalar head for reward models and critics (:mod:`~rlcourse.lm.scalar_head`,
:mod:`~rlcourse.lm.value_model`), many seeds stacked in one model (:mod:`~rlcourse.lm.seed_stack`), and multi-turn rollouts that alternate
the sampler with an environment (:mod:`~rlcourse.lm.multi_turn`, lesson 10e), and LoRA layers in plain torch
(:mod:`~rlcourse.lm.lora`, lesson 12b).
Lessons 07 on use it. It imports nothing from tasks, trainers, measurements or interop.

    from rlcourse.lm import load_checkpoint, sample, sequence_logprobs
    from rlcourse.tasks import AdditionTask
    model, tokenizer = load_checkpoint("addition-partial")
    task = AdditionTask()
    rollout = sample(model, tokenizer, task.prompts(8, rng=0), task.max_new_tokens)
    rewards = task.reward(rollout.prompts, rollout.completions)
"""
from rlcourse.lm.checkpoints import available_checkpoints, checkpoint_info, load_checkpoint, save_checkpoint
from rlcourse.lm.logprobs import (next_token_logprobs, position_ids_from_mask, sequence_logprobs,
                                  token_logprobs_from_logits)
from rlcourse.lm.model import SIZES, count_parameters, frozen_copy, make_model
from rlcourse.lm.sampling import Rollout, sample
from rlcourse.lm.scalar_head import ScalarHeadModel, score_completions
from rlcourse.lm.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from rlcourse.lm.value_model import make_value_model

__all__ = [
    "DEFAULT_ALPHABET", "Rollout", "SIZES", "ScalarHeadModel", "available_checkpoints", "build_char_tokenizer",
    "checkpoint_info", "count_parameters", "frozen_copy", "load_checkpoint", "make_model", "make_value_model",
    "next_token_logprobs", "position_ids_from_mask", "sample", "save_checkpoint", "score_completions",
    "sequence_logprobs", "token_logprobs_from_logits",
]
