"""Exact oracles and measurements: the numbers a lesson's claims rest on.

Exact answers where the problem is small enough to enumerate: the exact policy gradient of an
enumerable LM policy (:mod:`~rlcourse.measure.exact_gradient`, lessons 09-10) and its off-policy
corrections (:mod:`~rlcourse.measure.exact_off_policy`, lesson 10c), the preference bandit and the
optima of each preference loss (:mod:`~rlcourse.measure.categorical_bandit`,
:mod:`~rlcourse.measure.preference_optima`, lessons 11-11b), the Bayes limit of a reward model
(:mod:`~rlcourse.measure.bayes_limit`, lesson 08), the over-optimisation frontier
(:mod:`~rlcourse.measure.overoptimisation`, lesson 08b) and the length bias of GRPO's aggregation
(:mod:`~rlcourse.measure.length_bias`, lesson 10). Measurements of trained models: pass@k and
coverage (:mod:`~rlcourse.measure.coverage`), best-of-n (:mod:`~rlcourse.measure.best_of_n`), the
draws, per-seed series and batch drift of lesson 10b (:mod:`~rlcourse.measure.rlvr_runs`) and the capstone's
comparison of every algorithm (:mod:`~rlcourse.measure.capstone`, lesson 12); the forward KL from a base
model, the Pareto front and lesson 12b's forgetting and LoRA runs (:mod:`~rlcourse.measure.forgetting`,
:mod:`~rlcourse.measure.forgetting_runs`).
"""
from rlcourse.measure.best_of_n import best_of_n, best_of_n_kl
from rlcourse.measure.exact_gradient import EnumerablePolicy

__all__ = ["EnumerablePolicy", "best_of_n", "best_of_n_kl"]
