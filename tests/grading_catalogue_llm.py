"""Plausible wrong answers to the checks of lessons 07b-13 that only the probes added for the families
below catch (the layout of tests/grading_catalogue.py: ``CATALOGUE`` and the ``FAMILIES`` it promises).

Each answer passed the checks before its family's probe was added; tests/test_grading_families.py
asserts that every one now fails its check with a clean ``CheckFailed``.
"""

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.capstone import t_interval
from rlcourse.lm.trl_bridge import grpo_config_kwargs


# ------------------------------------------------------------------ an exponential that underflows under a log
def k3_log_of_exp(logp, logq):
    rho = torch.exp(logq - logp)
    return rho - 1 - torch.log(rho)            # log(0) = -inf once rho underflows


# ------------------------------------------------------------------ padding holding inf or nan
def aggregate_multiplies_by_the_mask(per_token, mask, loss_type, max_completion_length):
    m = mask.to(per_token.dtype)
    total = per_token * m                      # inf * 0 = nan
    if loss_type == "grpo":
        return (total.sum(1) / m.sum(1)).mean()
    if loss_type == "dapo":
        return total.sum() / m.sum()
    return total.sum() / (per_token.shape[0] * max_completion_length)


def sequence_ratio_multiplies_by_the_mask(logprobs, old_logprobs, mask):
    m = mask.to(logprobs.dtype)
    return torch.exp(((logprobs - old_logprobs) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True))


def pg_loss_multiplies_by_the_mask(logprobs, mask, advantages):
    return -(advantages.detach()[:, None] * logprobs * mask).sum() / logprobs.shape[0]


# ------------------------------------------------------------------ a setting string compared with `is`
def aggregate_compares_with_is(per_token, mask, loss_type, max_completion_length):
    m = mask.to(per_token.dtype)
    total = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if loss_type is "grpo":                    # noqa: F632  (the mistake itself)
        return (total.sum(1) / m.sum(1)).mean()
    if loss_type is "dapo":                    # noqa: F632
        return total.sum() / m.sum()
    return total.sum() / (per_token.shape[0] * max_completion_length)


# ------------------------------------------------------------------ randomness not drawn from the generator given
def rloo_estimate_from_global_rng(policy, rewards, K, generator):
    own = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    idx = policy.sample(K, own)[0]
    r = rewards[0, idx]
    adv = r - (r.sum() - r) / (K - 1)
    return (adv[:, None] * policy.score_matrix()[0, idx]).mean(0)


# ------------------------------------------------------------------ an experiment that ignores what it is given
def final_validity_on_seeds_0_1_2(run, algorithms, seeds, cfg):
    return {a: t_interval([run(a, s, cfg)["curve"][-1]["validity"] for s in range(len(seeds))]) for a in algorithms}


# ------------------------------------------------------------------ a reported result, not the thing measured
def eos_experiment_reported(policy, missing_eos_penalty):
    return 0.9 if missing_eos_penalty else 0.1


def really_distributed_by_the_flag(report, requested_processes):
    return (report["world_size"] == requested_processes == len(report["checksums"])
            and report["replicas_identical"])


# ------------------------------------------------------------------ the caller's model trained instead of a copy
def eos_experiment_on_the_reference(policy, missing_eos_penalty):
    with torch.no_grad():                     # stands for a trainer built on `policy` itself, not a copy
        for p in policy.parameters():
            p.mul_(1.01)
    return policy


# ------------------------------------------------------------------ a count in the other library's unit
def grpo_kwargs_max_steps_unchanged(config, task):
    out = grpo_config_kwargs(config, task)
    out["max_steps"] = config.max_steps       # TRL counts optimiser steps: num_iterations times fewer batches
    return out


CATALOGUE = [
    ("an exponential that underflows under a log", "check_kl_k3", k3_log_of_exp),
    ("padding holding inf or nan", "check_aggregate_loss", aggregate_multiplies_by_the_mask),
    ("padding holding inf or nan", "check_sequence_ratio", sequence_ratio_multiplies_by_the_mask),
    ("padding holding inf or nan", "check_policy_gradient_loss", pg_loss_multiplies_by_the_mask),
    ("a setting string compared with `is`", "check_aggregate_loss", aggregate_compares_with_is),
    ("randomness not drawn from the generator given", "check_rloo_gradient_estimate", rloo_estimate_from_global_rng),
    ("an experiment that ignores the seeds it is given", "check_final_validity_intervals", final_validity_on_seeds_0_1_2),
    ("a reported result instead of the thing measured", "check_eos_experiment", eos_experiment_reported),
    ("a reported result instead of the thing measured", "check_really_distributed", really_distributed_by_the_flag),
    ("the caller's model trained instead of a copy", "check_eos_experiment", eos_experiment_on_the_reference),
    ("a count in the other library's unit", "check_grpo_kwargs", grpo_kwargs_max_steps_unchanged),
]

FAMILIES = {"an exponential that underflows under a log", "padding holding inf or nan",
            "a setting string compared with `is`", "randomness not drawn from the generator given",
            "an experiment that ignores the seeds it is given", "a reported result instead of the thing measured",
            "the caller's model trained instead of a copy", "a count in the other library's unit"}
