"""Iterative DPO: rounds of rejection sampling and offline DPO, the pairs labelled by a reward model or raters.

Between offline DPO (one fixed set of pairs) and online DPO (fresh pairs at every step) sit the
*rounds* of Xiong et al. 2024 ("Iterative Preference Learning from Human Feedback", arXiv
2312.11456), Dong et al. 2024 ("RLHF Workflow: From Reward Modeling to Online RLHF", arXiv
2405.07863) and the rejection-sampling rounds of Llama 2 and 3: sample many answers with the
current policy, keep each prompt's best and worst by the reward model, then train DPO on those
pairs as on any offline data set, and start again from the result:

    pi_0 <- the starting policy;  pi_ref <- a frozen copy of it (or ref_model)
    for k in 0 .. rounds - 1:
        x      <- prompt_fn(prompts_per_round, seed * 100_003 + k), each num_generations times
        y      <- sample(pi_k, x)                                   # rlcourse.lm.sample
        s      <- reward_funcs(x, y)                                # online_dpo.rollout_scores
        pairs  <- online_dpo_pairs(s, prompt of each y) as text     # best against worst; a tie gives no pair
        ref_k  <- pi_ref, or pi_k if sync_ref_model
        pi_k+1 <- train_dpo(pi_k, pairs, max_steps, reference ref_k)   # a fresh AdamW and schedule

A round's DPO is :func:`rlcourse.trainers.dpo.train_dpo` (one model) or
:func:`rlcourse.trainers.dpo_seeds.train_dpo_seeds` (several seeds in one stack), on text pairs as a
data set of them would hold: each completion re-encoded with an ``<eos>`` after it (one the sampler
cut at ``max_new_tokens`` gains one). Round ``k`` of seed ``seed`` shuffles its pairs with seed
``seed * 100_003 + k``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from rlcourse.losses.beyond_dpo import online_dpo_pairs
from rlcourse.lm.model import frozen_copy
from rlcourse.lm.sampling import sample
from rlcourse.lm.seed_stack import seed_copies, stack_models
from rlcourse.trainers.dpo import train_dpo
from rlcourse.trainers.dpo_seeds import train_dpo_seeds
from rlcourse.trainers.online_dpo import OnlineDPOConfig, rollout_scores

__all__ = ["IterativeDPOConfig", "rejection_sampled_pairs", "train_iterative_dpo"]


@dataclass
class IterativeDPOConfig(OnlineDPOConfig):
    """:class:`~rlcourse.trainers.online_dpo.OnlineDPOConfig`'s sampling settings and DPO settings, per round:

    * ``rounds`` (3): sampling rounds, each followed by a DPO run from where the last one ended.
    * ``prompts_per_round`` (64): prompts sampled in a round, each ``num_generations`` times.
    * ``num_generations`` (**4** here): answers per prompt; the pair is the best against the worst.
    * ``max_steps`` (100): DPO steps *per round*, of ``per_device_train_batch_size`` pairs each.
    * ``sync_ref_model`` (False): False keeps the starting reference in every round; True makes each
      round's reference its starting policy. TRL's ``DPOConfig`` has the name (there it copies the
      policy into the reference every ``ref_model_sync_steps`` steps, TR-DPO); here the copy is made
      once per round.

    The loss is any pairwise loss of :class:`~rlcourse.trainers.dpo.DPOConfig`, as offline
    :func:`~rlcourse.trainers.dpo.train_dpo` computes it (``ipo`` averaged per token).
    """

    rounds: int = 3
    prompts_per_round: int = 64
    num_generations: int = 4
    sync_ref_model: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("rounds", "prompts_per_round"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def rejection_sampled_pairs(scores, prompts: list[str], completions: list[str],
                            num_generations: int) -> list[dict]:
    """``{"prompt", "chosen", "rejected"}`` text pairs: each prompt's best answer against its worst.

    ``prompts[i]``, ``completions[i]``, ``scores[i]`` (1-D): answer ``i``; the rows come in groups of
    ``num_generations`` answers to one prompt. The pairing is
    :func:`rlcourse.losses.beyond_dpo.online_dpo_pairs`'s: a group whose scores all tie gives no pair.
    """
    scores = torch.as_tensor(scores)
    if len(prompts) != len(completions) or scores.shape != (len(prompts),) or len(prompts) % num_generations:
        raise ValueError(f"prompts, completions and scores must be of one length, a multiple of num_generations "
                         f"({num_generations}); got {len(prompts)}, {len(completions)} and {tuple(scores.shape)}")
    groups = torch.arange(len(prompts) // num_generations).repeat_interleave(num_generations)
    chosen, rejected = online_dpo_pairs(scores, groups)
    return [{"prompt": prompts[w], "chosen": completions[w], "rejected": completions[l]}
            for w, l in zip(chosen.tolist(), rejected.tolist())]


def train_iterative_dpo(models, tokenizer, reward_funcs, prompt_fn, args: IterativeDPOConfig | None = None,
                        ref_model=None, seeds=None, progress: bool = True) -> list[list[dict]]:
    """Train every ``models[s]`` in place by ``args.rounds`` rounds of iterative DPO; one history per model.

    ``models``: one model per run (several must be plain GPT-2 models, trained as one seed stack; one
    may be any causal LM). ``reward_funcs``: ``f(prompts, completions) -> scores`` (each run calls its
    own deep copy) or a scalar-head reward model. ``prompt_fn(n, seed)`` makes prompts; ``max_new_tokens``
    defaults to its task's. ``ref_model`` (default: a frozen copy of each model as it is now) is every
    round's reference unless ``args.sync_ref_model``. ``seeds`` (default ``args.seed + s``) seed run
    ``s``'s sampling stream, prompts and shuffles. ``history[s][k]``: round ``k``'s ``pairs``,
    ``objective/scores`` (mean score of the samples), ``objective/scores_margin`` (mean best-minus-worst),
    ``val/contain_eos_token`` and ``loss`` (the round's mean DPO loss; absent without pairs).
    """
    args = args or IterativeDPOConfig()
    if not isinstance(args, IterativeDPOConfig):
        raise ValueError(f"args must be an IterativeDPOConfig, got {type(args).__name__}")
    models = list(models)
    S, G, P = len(models), args.num_generations, args.prompts_per_round
    seeds = [args.seed + s for s in range(S)] if seeds is None else [int(s) for s in seeds]
    if len(seeds) != S:
        raise ValueError(f"seeds must hold one seed per model ({S}), got {seeds}")
    max_new_tokens = args.max_new_tokens or getattr(getattr(prompt_fn, "__self__", None), "max_new_tokens", None)
    if max_new_tokens is None:
        raise ValueError("set args.max_new_tokens (prompt_fn is not a task's method that would give it)")
    if isinstance(reward_funcs, torch.nn.Module):
        reward_funcs.eval()
    rewards = seed_copies(reward_funcs, S, "reward_funcs")
    start_refs = [frozen_copy(m) for m in models] if ref_model is None else [ref_model] * S
    device = next(models[0].parameters()).device
    generators = [torch.Generator(device).manual_seed(s) for s in seeds]
    history: list[list[dict]] = [[] for _ in models]
    for k in tqdm(range(args.rounds), desc=f"iterative DPO x{S}", disable=not progress):
        prompts = [p for seed in seeds for p in prompt_fn(P, seed * 100_003 + k) for _ in range(G)]
        sampler = models[0] if S == 1 else stack_models(models)
        roll = sample(sampler, tokenizer, prompts, max_new_tokens, temperature=args.temperature,
                      generator=generators[0] if S == 1 else generators)
        scores = rollout_scores(rewards, roll, args.missing_eos_penalty)
        refs = [frozen_copy(m) for m in models] if args.sync_ref_model else start_refs
        round_pairs = []
        for s in range(S):
            block = slice(s * P * G, (s + 1) * P * G)
            round_pairs.append(rejection_sampled_pairs(scores[block].cpu(), prompts[block], roll.completions[block], G))
            spread = scores[block].view(P, G).amax(1) - scores[block].view(P, G).amin(1)   # best - worst per prompt
            history[s].append({"round": k + 1, "pairs": len(round_pairs[s]),
                               "objective/scores": float(scores[block].mean()),
                               "objective/scores_margin": float(spread[spread > 0].mean()) if len(round_pairs[s]) else 0.0,
                               "val/contain_eos_token": float(roll.finished[block].float().mean())})
        trained = [s for s in range(S) if round_pairs[s]]       # a run without a pair this round does not move
        configs = [dataclasses.replace(args, seed=seeds[s] * 100_003 + k) for s in trained]
        losses = []
        if S == 1 and trained:
            losses = [train_dpo(models[0], tokenizer, round_pairs[0], configs[0], ref_model=refs[0],
                                progress=False)["loss"]]
        elif trained:
            losses = [h["loss"] for h in train_dpo_seeds([models[s] for s in trained], tokenizer,
                                                         [round_pairs[s] for s in trained], configs,
                                                         seeds=[c.seed for c in configs],
                                                         ref_models=[refs[s] for s in trained], progress=False)]
        for s, loss in zip(trained, losses):
            history[s][-1]["loss"] = float(np.mean(loss))
    return history
