"""The catalogue of bad inputs: each must raise a clear error that names the argument.

Never a nan, never an exception from deep inside torch or NumPy. One row per case, so the
catalogue grows with the code: add a row whenever a new way to misuse a function is found.
"""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import kl, losses, returns
from rlcourse.classic.ppo import PPOConfig, train_ppo
from rlcourse.lm.logprobs import sequence_logprobs, token_logprobs_from_logits
from rlcourse.lm.model import make_model
from rlcourse.lm.tokenizer import build_char_tokenizer

nan, inf = float("nan"), float("inf")
_MODEL = []


def lm():
    """The tiny GPT (random weights; 81 tokens, 64 positions), built once."""
    if not _MODEL:
        _MODEL.append(make_model("tiny", build_char_tokenizer(), seed=0).eval())
    return _MODEL[0]


P_IDS, P_MASK = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
C_IDS, C_MASK = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)


def logprobs(prompt_ids=P_IDS, completion_ids=C_IDS, completion_mask=C_MASK, prompt_mask=P_MASK, temperature=1.0):
    return sequence_logprobs(lm(), prompt_ids, completion_ids, completion_mask, prompt_mask, temperature)
Z = np.zeros((2, 3))
T23 = torch.zeros(2, 3)
ONES = torch.ones(2, 3)

CASES = [
    # --- returns
    ("rtg 1-D rewards", lambda: returns.reward_to_go(np.zeros(3), 0.9), ValueError, r"rewards must have shape \(N, T\)"),
    ("rtg gamma < 0", lambda: returns.reward_to_go(Z, -0.1), ValueError, r"gamma must be in \[0, 1\]"),
    ("rtg gamma nan", lambda: returns.reward_to_go(Z, nan), ValueError, r"gamma must be in \[0, 1\]"),
    ("rtg gamma bool", lambda: returns.reward_to_go(Z, True), ValueError, r"gamma must be in \[0, 1\]"),
    ("rtg nan reward", lambda: returns.reward_to_go([[1.0, nan]], 0.9), ValueError, r"rewards hold nan or inf at 1 real"),
    ("rtg text rewards", lambda: returns.reward_to_go("abc", 0.9), TypeError, r"rewards must be an array"),
    ("rtg mask shape", lambda: returns.reward_to_go(Z, 0.9, mask=np.ones((2, 2))), ValueError,
     r"mask must have the shape of rewards \(2, 3\)"),
    ("rtg mask not 0/1", lambda: returns.reward_to_go(Z, 0.9, mask=2 * np.ones((2, 3))), ValueError, r"mask must hold only 0/1"),
    ("rtg dones shape", lambda: returns.reward_to_go(Z, 0.9, dones=[1, 0]), ValueError, r"dones must have the shape"),
    ("episode_returns nan", lambda: returns.episode_returns([[inf, 1.0]], 1.0), ValueError, r"rewards hold nan or inf"),
    ("discounted_return nan", lambda: returns.discounted_return([1.0, nan], 0.9), ValueError, r"rewards must be finite"),
    ("discount_weights 1-D", lambda: returns.discount_weights(np.ones(3), 0.9), ValueError, r"mask must have shape \(N, T\)"),
    ("gae lambda > 1", lambda: returns.gae(Z, Z, 0.9, 1.5), ValueError, r"gae_lambda must be in \[0, 1\]"),
    ("gae nan value", lambda: returns.gae(Z, [[0, 0, nan], [0, 0, 0]], 0.9, 0.9), ValueError, r"values hold nan or inf"),
    ("gae values shape", lambda: returns.gae(Z, np.zeros((3, 2)), 0.9, 0.9), ValueError, r"values must have the shape"),
    ("gae truncation without next_values",
     lambda: returns.gae(Z, Z, 0.9, 0.9, truncated=[[1, 0, 0], [0, 0, 0]]), ValueError, r"pass next_values"),
    ("gae both bootstraps", lambda: returns.gae(Z, Z, 0.9, 0.9, next_values=Z, last_value=np.zeros(2)), ValueError,
     r"either next_values or last_value"),
    ("gae last_value shape", lambda: returns.gae(Z, Z, 0.9, 0.9, last_value=np.zeros(3)), ValueError,
     r"last_value must be a number or have shape \(N,\)"),
    ("gae last_value nan", lambda: returns.gae(Z, Z, 0.9, 0.9, last_value=nan), ValueError, r"last_value must be finite"),
    ("gae nan next_value", lambda: returns.gae(Z, Z, 0.9, 0.9, next_values=[[nan, 0, 0], [0, 0, 0]]), ValueError,
     r"next_values hold nan"),
    ("n_step n = 0", lambda: returns.n_step_returns(Z, Z, 0.9, 0), ValueError, r"n must be an integer >= 1"),
    ("n_step n float", lambda: returns.n_step_returns(Z, Z, 0.9, 2.0), ValueError, r"n must be an integer >= 1"),
    ("whiten empty mask", lambda: returns.whiten(Z, mask=np.zeros((2, 3))), ValueError, r"mask selects no entries"),
    ("whiten eps < 0", lambda: returns.whiten(Z, eps=-1.0), ValueError, r"eps must be >= 0"),
    ("whiten nan", lambda: returns.whiten([1.0, nan]), ValueError, r"values hold nan or inf"),
    # --- losses
    ("reinforce 1-D logprobs", lambda: losses.reinforce_loss(torch.zeros(3), torch.zeros(3)), ValueError,
     r"logprobs must be a torch tensor of shape \(N, T\)"),
    ("reinforce integer logprobs", lambda: losses.reinforce_loss(torch.zeros(2, 3, dtype=torch.long), 1.0), ValueError,
     r"logprobs must be a torch tensor of shape \(N, T\) holding floats"),
    ("reinforce empty batch", lambda: losses.reinforce_loss(torch.zeros(0, 3), 1.0), ValueError, r"at least one sequence"),
    ("reinforce T = 0", lambda: losses.reinforce_loss(torch.zeros(2, 0), 1.0), ValueError, r"at least one step"),
    ("reinforce psi (N,) with N == T", lambda: losses.reinforce_loss(torch.zeros(3, 3), torch.ones(3)), ValueError,
     r"use psi\[:, None\]"),
    ("reinforce psi nan", lambda: losses.reinforce_loss(T23, torch.tensor([[nan], [1.0]])), ValueError, r"psi hold nan"),
    ("reinforce mask shape", lambda: losses.reinforce_loss(T23, 1.0, [[1, 1]]), ValueError, r"mask must have shape \(2, 3\)"),
    ("reinforce mask object", lambda: losses.reinforce_loss(T23, 1.0, object()), TypeError, r"mask must be a tensor"),
    ("masked_mean empty", lambda: losses.masked_mean(torch.zeros(0)), ValueError, r"nothing to average"),
    ("masked_mean no entries", lambda: losses.masked_mean(T23, torch.zeros(2, 3)), ValueError, r"nothing to average"),
    ("masked_mean numpy", lambda: losses.masked_mean(Z), TypeError, r"x must be a torch tensor"),
    ("ppo shapes", lambda: losses.ppo_clip_loss(T23, torch.zeros(3, 2), T23), ValueError, r"must have one shape"),
    ("ppo nan advantage", lambda: losses.ppo_clip_loss(T23, T23, torch.tensor([[nan, 0, 0], [0, 0, 0]])), ValueError,
     r"advantages hold nan"),
    ("ppo nan logprob", lambda: losses.ppo_clip_loss(torch.tensor([[nan, 0, 0], [0, 0, 0]]), T23, T23), ValueError,
     r"logprobs hold nan"),
    ("ppo inf old logprob", lambda: losses.ppo_clip_loss(T23, torch.tensor([[-inf, 0, 0], [0, 0, 0]]), T23), ValueError,
     r"old_logprobs hold nan or inf"),
    ("ppo negative clip", lambda: losses.ppo_clip_loss(T23, T23, T23, clip_coef=-0.1), ValueError, r"must be >= 0"),
    ("value clip without old", lambda: losses.value_loss(T23, T23, clip_coef=0.2), ValueError, r"old_values is required"),
    ("value nan target", lambda: losses.value_loss(T23, torch.tensor([[nan, 0, 0], [0, 0, 0]])), ValueError,
     r"returns hold nan"),
    ("penalty beta nan", lambda: losses.ppo_penalty_loss(T23, T23, T23, T23, nan), ValueError, r"beta must be >= 0"),
    ("adaptive beta nan kl", lambda: losses.adaptive_kl_beta(1.0, nan, 0.01), ValueError, r"kl must be a finite number"),
    ("adaptive beta 0", lambda: losses.adaptive_kl_beta(0.0, 0.01, 0.01), ValueError, r"expected beta > 0"),
    ("entropy scalar", lambda: losses.entropy_bonus(torch.tensor(1.0)), ValueError, r"logits must be a torch tensor"),
    ("trajectory weight nan", lambda: losses.trajectory_importance_weight(torch.tensor([[nan]]), torch.zeros(1, 1)),
     ValueError, r"logprobs hold nan"),
    # --- kl
    ("k1 shapes", lambda: kl.kl_k1(torch.zeros(3), torch.zeros(2)), ValueError, r"logp and logq must have the same shape"),
    ("k3 integers", lambda: kl.kl_k3(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), TypeError,
     r"floating-point"),
    ("k2 mask shape", lambda: kl.kl_k2(torch.zeros(3), torch.zeros(3), mask=[1, 0]), ValueError, r"mask must have shape \(3,\)"),
    ("exact_kl logits", lambda: kl.exact_kl(torch.ones(2, 4), torch.ones(2, 4)), ValueError, r"Were these logits"),
    ("entropy scalar", lambda: kl.entropy(torch.tensor(0.0)), ValueError, r"vocabulary dimension"),
    # --- lm.logprobs (each used to fail deep inside torch, or silently)
    ("right-padded prompt", lambda: logprobs(prompt_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])), ValueError,
     r"prompt_mask must be 1 in the last column.*padding_side='left'"),
    ("more tokens than positions", lambda: logprobs(completion_ids=torch.ones(2, 70, dtype=torch.long),
                                                    completion_mask=torch.ones(2, 70)), ValueError, r"real tokens.*positions"),
    ("token id outside the vocabulary", lambda: logprobs(completion_ids=torch.full((2, 4), 81)), ValueError,
     r"completion_ids must hold token ids in \[0, 81\)"),
    ("float token ids", lambda: logprobs(completion_ids=C_IDS.float()), ValueError, r"completion_ids must be an integer tensor"),
    ("nan temperature", lambda: logprobs(temperature=nan), ValueError, r"temperature must be a finite number > 0"),
    ("zero temperature", lambda: token_logprobs_from_logits(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), 0.0),
     ValueError, r"temperature"),
    ("completion mask not 0/1", lambda: logprobs(completion_mask=2 * C_MASK), ValueError, r"completion_mask must hold only 0/1"),
    ("no completion mask", lambda: logprobs(completion_mask=None), ValueError, r"completion_mask is required"),
    # --- trainers: never a silent no-op, never nan parameters
    ("PPO budget below one batch", lambda: train_ppo(total_timesteps=100, progress=False), ValueError,
     r"total_timesteps=100 is less than one batch"),
    ("PPO one-sample minibatches", lambda: PPOConfig(total_timesteps=16, num_envs=2, num_steps=8, num_minibatches=16),
     ValueError, r"num_minibatches=16.*norm_adv"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()
