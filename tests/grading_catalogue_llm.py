"""Plausible wrong answers to the checks of lessons 07b-13 that only the probes added for the families
below catch (the layout of tests/grading_catalogue.py: ``CATALOGUE`` and the ``FAMILIES`` it promises).

Each answer passed the checks before its family's probe was added; tests/test_grading_families.py
asserts that every one now fails its check with a clean ``CheckFailed``.
"""

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import torch

from rlcourse.stats import t_interval
from rlcourse.interop.trl_bridge import grpo_config_kwargs


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


# ------------------------------------------------------------------ float64 inputs answered in float32
def exact_kl_in_float32(logits_p, logits_q):
    logp, logq = torch.log_softmax(logits_p.float(), -1), torch.log_softmax(logits_q.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def k3_in_float32(logp, logq):
    log_r = (logq - logp).float()
    return torch.exp(log_r) - 1 - log_r


# ------------------------------------------------------------------ a result cut from the graph a later step differentiates
def k3_through_numpy(logp, logq):
    log_r = (logq - logp).detach().numpy()
    return torch.from_numpy(np.exp(log_r) - 1 - log_r)


# ------------------------------------------------------------------ a constant seed, or a fixed count, instead of the one given
def _kl_estimators(logits_p, logits_q, n_samples, seed):
    g = torch.Generator().manual_seed(seed)
    logp_all, logq_all = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    x = torch.multinomial(logp_all.exp(), n_samples, replacement=True, generator=g)
    log_r = logq_all[x] - logp_all[x]
    k1, k3 = -log_r, log_r.exp() - 1 - log_r
    return {"k1": (k1.mean(), k1.std()), "k3": (k3.mean(), k3.std())}


def kl_estimators_seed_0(logits_p, logits_q, n_samples, seed):
    return _kl_estimators(logits_p, logits_q, n_samples, 0)


def kl_estimators_20000_samples(logits_p, logits_q, n_samples, seed):
    return _kl_estimators(logits_p, logits_q, 20000, seed)


def kl_estimators_unseeded(logits_p, logits_q, n_samples, seed):
    return _kl_estimators(logits_p, logits_q, n_samples, int(torch.randint(0, 2**31, ())))


# ------------------------------------------------------------------ lesson 08: padding on one side, nan in padding, cut graphs
def bradley_terry_through_item(rewards_chosen, rewards_rejected, margin=None):
    d = rewards_chosen - rewards_rejected - (0 if margin is None else margin)
    return torch.tensor(float(-torch.nn.functional.logsigmoid(d).mean()), dtype=d.dtype)


def bradley_terry_in_float32(rewards_chosen, rewards_rejected, margin=None):
    d = rewards_chosen - rewards_rejected - (0 if margin is None else margin)
    return -torch.nn.functional.logsigmoid(d.float()).mean()


def score_by_one_hot(values, mask):
    last = torch.where(mask.bool(), torch.arange(mask.shape[1]), -1).max(1).values
    return (values * torch.nn.functional.one_hot(last, mask.shape[1])).sum(1)


def score_detached(values, mask):
    last = torch.where(mask.bool(), torch.arange(mask.shape[1]), -1).max(1).values
    return values.detach().gather(1, last[:, None]).squeeze(1)


def kl_rewards_score_at_count(scores, logprobs, ref_logprobs, mask, kl_coef):
    rewards = -kl_coef * (logprobs.detach() - ref_logprobs) * mask
    return rewards.index_put((torch.arange(len(scores)), mask.long().sum(1) - 1), scores, accumulate=True)


def token_gae_over_the_first_positions(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    out = torch.zeros_like(rewards)
    for b in range(B):
        n, running = int(mask[b].sum()), 0.0
        for t in reversed(range(n)):
            nxt = values[b, t + 1] if t + 1 < n else 0.0
            running = rewards[b, t] + gamma * nxt - values[b, t] + gamma * lam * running
            out[b, t] = running
    return out


# ------------------------------------------------------------------ a reported result, not the thing measured (08-11b)
def length_bias_reported(loss_type, seed):                # the lesson's curve, not the trained policy's table
    from rlcourse.measure.length_bias import wrong_answer_lengths
    return wrong_answer_lengths(loss_type, seed)


def mismatch_accuracies_reported(start, tokenizer, settings):   # eight plausible accuracies, nothing trained
    return [0.45, 0.44, 0.41, 0.46, 0.43, 0.44, 0.42, 0.45] if settings is None else [0.38] * 8


def fit_dpo_closed_form(bandit, pairs, beta):            # pi* from the hidden reward: no comparison read
    return torch.log_softmax(bandit.ref_logprobs + bandit.reward / beta, -1)


def fit_simpo_closed_form(bandit, pairs, lengths, beta):
    from rlcourse.measure.preference_optima import simpo_optimum
    return simpo_optimum(bandit.reward, lengths, beta)


# ------------------------------------------------------------------ an input the check used to hold at one value
def audit_with_the_lesson_gold_score(pairs, gold_score):
    from rlcourse.tasks.preference import PreferenceTask
    gold = PreferenceTask().gold_score                     # the argument ignored

    def share(values):
        return float(np.mean([1.0 if v > 0 else 0.5 if v == 0 else 0.0 for v in values]))
    return (share([gold(p["prompt"], p["chosen"]) - gold(p["prompt"], p["rejected"]) for p in pairs]),
            share([len(p["chosen"]) - len(p["rejected"]) for p in pairs]))


def completion_logprobs_without_grad(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():                                  # right numbers; nothing for DPO's loss to differentiate
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    P = prompt_ids.shape[1]
    token = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return token * completion_mask


def ppo_losses_whitened_per_minibatch(policy, value_model, mb, cliprange=0.2, cliprange_value=0.2):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.lm.value_model import token_values
    from rlcourse.returns import whiten

    mask = mb["completion_mask"]
    real = mask.bool()
    logprobs = sequence_logprobs(policy, mb["prompt_ids"], mb["completion_ids"], mask, mb["prompt_mask"])
    values = token_values(value_model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mask)
    ratio = torch.exp(logprobs - mb["logprobs"])
    a = whiten(mb["advantages"], mask)                     # whitened again: a no-op only on the whole rollout
    policy_loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cliprange, 1 + cliprange))[real].mean()
    moved = mb["values"] + (values - mb["values"]).clamp(-cliprange_value, cliprange_value)
    value_loss = 0.5 * torch.maximum((values - mb["returns"]) ** 2, (moved - mb["returns"]) ** 2)[real].mean()
    return policy_loss, value_loss


def dpo_step_with_the_checkpoint_as_reference(model, ref_model, optimizer, batch, beta):
    import torch.nn.functional as F
    from rlcourse.lm import load_checkpoint, sequence_logprobs

    ref_model = load_checkpoint("preference-sft", device="cpu")[0].eval()     # the argument ignored
    args = (batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"], batch["prompt_mask"])
    chosen, rejected = sequence_logprobs(model, *args).sum(-1).chunk(2)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logprobs(ref_model, *args).sum(-1).chunk(2)
    loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


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
    ("float64 inputs answered in float32", "check_exact_kl", exact_kl_in_float32),
    ("float64 inputs answered in float32", "check_kl_k3", k3_in_float32),
    ("a result cut from the graph a later step differentiates", "check_kl_k3", k3_through_numpy),
    ("a constant seed instead of the one given", "check_kl_estimators", kl_estimators_seed_0),
    ("a fixed number of samples instead of the one given", "check_kl_estimators", kl_estimators_20000_samples),
    ("randomness not drawn from the generator given", "check_kl_estimators", kl_estimators_unseeded),
    ("a result cut from the graph a later step differentiates", "check_bradley_terry_loss", bradley_terry_through_item),
    ("float64 inputs answered in float32", "check_bradley_terry_loss", bradley_terry_in_float32),
    ("padding holding inf or nan", "check_score_at_last_token", score_by_one_hot),
    ("a result cut from the graph a later step differentiates", "check_score_at_last_token", score_detached),
    ("padding on one side only", "check_kl_shaped_rewards", kl_rewards_score_at_count),
    ("padding on one side only", "check_token_gae", token_gae_over_the_first_positions),
    ("a reported result instead of the thing measured", "check_length_bias_experiment", length_bias_reported),
    ("a reported result instead of the thing measured", "check_mismatch_run", mismatch_accuracies_reported),
    ("a closed form from the hidden reward instead of a fit to the data", "check_fit_dpo_policy", fit_dpo_closed_form),
    ("a closed form from the hidden reward instead of a fit to the data", "check_fit_simpo_policy",
     fit_simpo_closed_form),
    ("an input the check used to hold at one value", "check_audit_labels", audit_with_the_lesson_gold_score),
    ("an input the check used to hold at one value", "check_completion_logprobs", completion_logprobs_without_grad),
    ("an input the check used to hold at one value", "check_ppo_losses", ppo_losses_whitened_per_minibatch),
    ("an input the check used to hold at one value", "check_dpo_step", dpo_step_with_the_checkpoint_as_reference),
]

FAMILIES = {"an exponential that underflows under a log", "padding holding inf or nan",
            "a setting string compared with `is`", "randomness not drawn from the generator given",
            "an experiment that ignores the seeds it is given", "a reported result instead of the thing measured",
            "the caller's model trained instead of a copy", "a count in the other library's unit",
            "float64 inputs answered in float32", "a result cut from the graph a later step differentiates",
            "a constant seed instead of the one given", "a fixed number of samples instead of the one given",
            "padding on one side only", "a closed form from the hidden reward instead of a fit to the data",
            "an input the check used to hold at one value"}
