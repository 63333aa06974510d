"""The library functions that compute an answer, under any name: what checks name in ``@references``.

``python -m rlcourse grade`` turns each reference of a check into a tripwire in the process that
runs the learner's function (:mod:`rlcourse.tools.grade_worker`), so an answer that calls one, by
any route, is reported. A reference is named here when it computes the answer (or a piece of it that
the exercise asks for) for *some* choice of its arguments: lesson 08's Bradley-Terry loss on
beta-scaled log-ratios is DPO's, SimPO's on log-ratios with a zero margin too. A check names the
groups whose functions would pass it, minus those its exercise hands the learner (lesson 10c's step
calls the course's ``per_token_loss``; lesson 11b's round calls ``dpo_sigmoid_loss``), plus its own
module's reference helpers (the reference step or run it compares with).

Tripwiring a function that composes others also trips every caller, so naming the pieces catches
the trainers built on them; the trainers are named as well, so that a change of what they call
cannot open a route. ``tests/test_grading_references.py`` checks that every name resolves, that each
one fires under the grader, and that the cheats a learner could build from these routes are caught.
"""
from __future__ import annotations

# -log sigmoid(a - b) per pair, in every form the library has: with a = beta log-ratio of the chosen answer
# and b that of the rejected one it is DPO, with rewards it is Bradley-Terry.
SIGMOID_PAIR_LOSSES = (
    "rlcourse.losses.reward_model:bradley_terry_loss",      # on beta-scaled log-ratios: DPO
    "rlcourse.losses.dpo:dpo_sigmoid_loss",
    "rlcourse.losses.dpo:robust_dpo_loss",                  # label_smoothing = 0 is DPO
    "rlcourse.losses.dpo:conservative_dpo_loss",            # label_smoothing = 0 is DPO
    "rlcourse.losses.dpo:preference_loss",
    "rlcourse.losses.beyond_dpo:simpo_loss",                # on log-ratios, gamma = 0: DPO; on rewards, gamma = margin: BT
    "rlcourse.losses.beyond_dpo:rdpo_loss",                 # alpha = 0 is DPO
    "rlcourse.losses.beyond_dpo:preference_objective",
)
# The log-ratio pieces of DPO's loss.
DPO_PIECES = ("rlcourse.losses.dpo:dpo_logratio_margin", "rlcourse.losses.dpo:dpo_implicit_reward")
# The course's preference trainers: a batch's loss, a run, a round of online DPO, rounds of iterative DPO.
PREFERENCE_TRAINERS = (
    "rlcourse.trainers.dpo:batch_loss", "rlcourse.trainers.dpo:train_dpo",
    "rlcourse.trainers.dpo_seeds:seed_losses", "rlcourse.trainers.dpo_seeds:train_dpo_seeds",
    "rlcourse.trainers.online_dpo:OnlineDPOTrainer.step", "rlcourse.trainers.online_dpo:OnlineDPOTrainer.train",
    "rlcourse.trainers.online_dpo:OnlineDPOTrainer._update", "rlcourse.trainers.iterative_dpo:train_iterative_dpo",
)
# Where a tabular policy fitted to preferences lands, computed rather than fitted.
PREFERENCE_OPTIMA = (
    "rlcourse.measure.categorical_bandit:train_tabular_policy", "rlcourse.measure.categorical_bandit:CategoricalBandit.optimal_logprobs",
    "rlcourse.regularised_optimum:kl_regularised_optimum", "rlcourse.measure.preference_optima:expected_preference_loss",
    "rlcourse.measure.preference_optima:minimise_expected_loss",
)
DPO_LOSS = SIGMOID_PAIR_LOSSES + DPO_PIECES + PREFERENCE_TRAINERS

# A sampled batch's advantages, by group (GRPO), leave-one-out (RLOO), or as the trainer computes them.
ADVANTAGES = (
    "rlcourse.losses.grpo:group_advantages",
    "rlcourse.losses.grpo:leave_one_out_advantages",        # = group_advantages(scale_rewards="none") * K / (K - 1)
    "rlcourse.losses.grpo:batch_mean_advantages",
    "rlcourse.trainers.policy_gradient:advantages",
    "rlcourse.measure.exact_gradient:_advantages",
)
# The policy-gradient losses: per token, aggregated, clipped, REINFORCE's, RLOO's, PPO-RLHF's.
POLICY_GRADIENT_LOSSES = (
    "rlcourse.losses.grpo:per_token_loss", "rlcourse.losses.grpo:aggregate_loss", "rlcourse.losses.grpo:rloo_loss",
    "rlcourse.losses.grpo:importance_weights",
    "rlcourse.losses.policy_gradient:reinforce_loss", "rlcourse.losses.policy_gradient:ppo_clip_loss",
    "rlcourse.losses.policy_gradient:ppo_clip_objective", "rlcourse.losses.policy_gradient:importance_ratio",
    "rlcourse.losses.policy_gradient:trajectory_importance_weight",
    "rlcourse.trainers.ppo_rlhf:ppo_rlhf_loss", "rlcourse.trainers.ppo_rlhf:minibatch_loss",
    "rlcourse.interop.trl_parity:rlcourse_grpo_loss",
)
# The course's policy-gradient trainer: its loss and its steps.
POLICY_GRADIENT_TRAINER = (
    "rlcourse.trainers.policy_gradient:loss_and_stats",
    "rlcourse.trainers.policy_gradient:PolicyGradientTrainer._loss", "rlcourse.trainers.policy_gradient:PolicyGradientTrainer.step",
    "rlcourse.trainers.policy_gradient:PolicyGradientTrainer.make_batch",
    "rlcourse.trainers.policy_gradient:PolicyGradientTrainer.train",
    "rlcourse.trainers.policy_gradient_seeds:SeedBatchedPolicyGradientTrainer.losses",
    "rlcourse.trainers.policy_gradient_seeds:SeedBatchedPolicyGradientTrainer.step",
    "rlcourse.trainers.policy_gradient_seeds:SeedBatchedPolicyGradientTrainer.make_batch",
    "rlcourse.trainers.policy_gradient_seeds:SeedBatchedPolicyGradientTrainer.train",
)
POLICY_GRADIENT_STEP = ADVANTAGES + POLICY_GRADIENT_LOSSES + POLICY_GRADIENT_TRAINER
# The KL penalty of RLOO's reward, per token or summed.
KL_PENALTY = ("rlcourse.kl:kl_k1", "rlcourse.trainers.ppo_rlhf:kl_shaped_rewards")

# PPO-RLHF's trainer: its rewards, advantages, loss and steps.
PPO_RLHF_TRAINER = (
    "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.token_rewards", "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.advantages",
    "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.loss", "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.step",
    "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.train",
    "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.token_rewards",
    "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.advantages",
    "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.losses",
    "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.loss",
    "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.step",
)

# Lesson 10c's off-policy corrections (its exercises hand out group_advantages, per_token_loss and aggregate_loss).
OFF_POLICY_CORRECTIONS = (
    "rlcourse.losses.off_policy:sampler_importance_weights", "rlcourse.losses.off_policy:off_policy_sequence_mask",
    "rlcourse.trainers.policy_gradient:attach_sampler_logprobs",
)
# An online-DPO round (lesson 11b's exercises hand out dpo_sigmoid_loss): the pairs and the trainers.
ONLINE_DPO = ("rlcourse.losses.beyond_dpo:online_dpo_pairs",) + PREFERENCE_TRAINERS + (
    "rlcourse.losses.beyond_dpo:preference_objective",)
# Lesson 10b's strict judge of a filler-addition answer, and the rewards built on it.
STRICT_FILLER_REWARD = (
    "rlcourse.tasks.arithmetic:FillerAdditionTask.is_right", "rlcourse.tasks.arithmetic:FillerAdditionTask.reward",
    "rlcourse.tasks.verifiers:FillerVerifiers.is_right", "rlcourse.tasks.verifiers:FillerVerifiers.answer_reward",
    "rlcourse.tasks.verifiers:FillerVerifiers.format_reward", "rlcourse.tasks.verifiers:extract_answer",
)

# Lesson 10e's multi-turn pieces: the masked loss, the per-turn advantages and the trainer built on them (its
# exercises hand out rollout, group_advantages and sequence_logprobs where a step needs them).
MULTI_TURN = (
    "rlcourse.losses.multi_turn:multi_turn_loss", "rlcourse.losses.multi_turn:process_advantages",
    "rlcourse.trainers.multi_turn:MultiTurnTrainer.step", "rlcourse.trainers.multi_turn:MultiTurnTrainer.advantages",
    "rlcourse.trainers.multi_turn:MultiTurnTrainer.train",
)

# Lesson 11c's distillation divergences (exact over the vocabulary) and the course's distillation trainer.
DISTILLATION = (
    "rlcourse.losses.distillation:generalized_jsd_per_token", "rlcourse.losses.distillation:reverse_kl_per_token",
    "rlcourse.losses.distillation:forward_kl_per_token", "rlcourse.losses.distillation:generalized_jsd",
    "rlcourse.kl:exact_kl",
    "rlcourse.trainers.distillation:DistillationTrainer.losses", "rlcourse.trainers.distillation:DistillationTrainer.step",
    "rlcourse.trainers.distillation:DistillationTrainer.train", "rlcourse.trainers.distillation:train_distillation",
)

# Each grading module's own reference helpers: the reference step, run or measurement its checks compare
# with, which an answer could call as well. :func:`rlcourse.grading._core.references` adds them to every check
# of the module, and those of the shared ``_steps.py`` (none yet: its machinery runs the learner's step and
# computes no answer) to every check.
REFERENCE_HELPERS = {
    "_steps": (),
    "lesson03": ("_episode_gradients",),
    "lesson04": ("_batch_td_reference",),
    "lesson06": ("_update_kl_reference",),
    "lesson07b": ("_k3_through_exponentials",),
    "lesson08": ("_reference_ppo_update", "_reference_ppo_losses"),
    "lesson08b": ("_optimum_stats",),
    "lesson09": ("_reference_rloo_step", "_reference_rloo_kl_step"),
    "lesson10": ("_reference_update",),
    "lesson10b": ("_reference", "_subsets_pass_at_k"),
    "lesson10c": ("_reference_update", "_reference_run", "_variant_gradients", "_bounded"),
    "lesson10e": ("_reference_step",),
    "lesson11": ("_reference_dpo_step", "optimum_of_the_data"),
    "lesson11b": ("_online_round", "_reference_online_dpo", "_orpo_terms"),
    "lesson11c": ("_reference_step", "_reverse_reference", "_jsd_reference"),
    "lesson12b": ("_reference_rft_step",),
}


def helpers_of(module: str) -> tuple[str, ...]:
    """``"module:helper"`` for the reference helpers of the grading module ``module`` (``rlcourse.grading.llm.lessonNN`` or ``classic``)
    and the shared ones of ``rlcourse.grading._steps``."""
    shared = tuple(f"rlcourse.grading._steps:{name}" for name in REFERENCE_HELPERS["_steps"])
    return tuple(f"{module}:{name}" for name in REFERENCE_HELPERS.get(module.rpartition(".")[2], ())) + shared
