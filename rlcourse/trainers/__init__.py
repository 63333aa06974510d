"""Language-model trainers: thin loops over the sampler (:mod:`rlcourse.lm`) and the losses (:mod:`rlcourse.losses`).

SFT (:mod:`~rlcourse.trainers.sft`, lesson 07 and the checkpoints), the critic-free policy gradient
of REINFORCE, RLOO and the GRPO family (:mod:`~rlcourse.trainers.policy_gradient`, with DAPO's
dynamic sampling in :mod:`~rlcourse.trainers.dynamic_sampling`; lessons 09-10c, 12), PPO-RLHF
with a critic (:mod:`~rlcourse.trainers.ppo_rlhf`, lessons 08-08b), offline DPO and its relatives
(:mod:`~rlcourse.trainers.dpo`, lessons 11-11b), online DPO (:mod:`~rlcourse.trainers.online_dpo`)
and iterative DPO (:mod:`~rlcourse.trainers.iterative_dpo`, lesson 11b), and GRPO on multi-turn episodes
with a tool (:mod:`~rlcourse.trainers.multi_turn`, lesson 10e), and distillation from a frozen teacher,
on-policy or on the teacher's samples (:mod:`~rlcourse.trainers.distillation`, lesson 11c), and rejection-sampling
fine-tuning (:mod:`~rlcourse.trainers.rft`, lesson 12b). Settings and logged metrics
carry TRL's names. Each ``*_seeds`` module trains several independent seeds of the trainer beside it
in one seed-stacked model (lesson 08b on), every seed the run its single-seed twin makes; three of them
run their steps through one loop (:func:`~rlcourse.trainers.steps.run_steps`).
"""
from rlcourse.trainers.dpo import DPOConfig, train_dpo
from rlcourse.trainers.distillation import DistillationConfig, DistillationTrainer, train_distillation
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.trainers.sft import exact_match, train_sft

__all__ = ["DPOConfig", "PPOConfig", "PPORLHFTrainer", "PolicyGradientConfig", "PolicyGradientTrainer", "exact_match",
           "train_dpo", "train_sft", "DistillationConfig", "DistillationTrainer", "train_distillation"]
