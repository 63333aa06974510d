"""Multi-turn rollouts: a policy that alternates with an environment (tool calls), as token tensors.

An episode is one token sequence, ``[prompt | completion]``, whose completion interleaves the
tokens the policy sampled with the tokens the environment wrote:

    <bos>12+34+56=  (12+34)  =46;  (46+56)  =102;  102<eos>
    prompt          policy   env   policy   env    policy

The environment is any object with ``reset(prompt) -> str`` (text appended to the prompt),
``step(model_text) -> (observation_text, done, reward)`` and ``call_end``, the one-token string
that ends a tool call (:class:`rlcourse.tasks.tool_env.CalculatorEnv`). TRL's ``environment_factory``
environments, verl's multi-turn rollouts and OpenRLHF's agent functions have this shape.

:func:`rollout` alternates the sampler and the environment:

    for turn in 1 .. max_turns:
        y_k      <- sample(pi, episode so far) until <eos> or call_end      # rlcourse.lm.sample
        (o_k, done, r_k) <- env.step(text of y_k)
        append y_k (policy mask 1, its sampler log-probs), then o_k (mask 0, log-prob 0)

and returns :class:`Episodes`: the tokens, which of them the policy wrote (``policy_mask``, TRL's
``tool_mask`` / ``env_mask`` times its ``completion_mask``), the sampler's log-probs of those
tokens, the turn of every token, the number of turns, the rewards and why each episode ended.

Why it ended (``end_reasons``):

* ``"answer"``: the policy ended a turn with ``<eos>`` and the environment ended the episode;
* ``"malformed"``: the policy ended a turn with ``call_end`` and the environment ended the episode
  (a call that does not parse; the error observation is kept when it fits);
* ``"turns"``: ``max_turns`` turns, the last one a call;
* ``"budget"``: the completion reached ``max_completion_length`` tokens, policy and environment
  tokens together (TRL's budget): a turn cut mid-way (the tokens past the budget are dropped),
  a turn that wrote ``max_turn_tokens`` tokens without ending, or an observation that would not fit
  (not appended, as TRL rolls it back);
* ``"context"``: the episode would pass the model's positions (``n_positions``): an observation that
  does not fit is not appended, and a turn starts only if ``max_turn_tokens`` more tokens fit.

An episode cut by the loop (``turns``, ``budget``, ``context``) gets reward 0; otherwise its reward
is that of the environment's last step. The length of a response is ``policy_mask.sum(1)``, the
tokens the policy wrote, not the span ``completion_mask.sum(1)``.

Details that matter:

* each turn re-encodes the episode text; the loop checks that this gives back exactly the tokens
  it holds (true for the course's character tokenizer; a BPE tokenizer can merge across a turn
  boundary, and then the sampler would condition on tokens that are not the trajectory's:
  ``ValueError``);
* seed-batched: on a seed-stacked model (:mod:`rlcourse.lm.seed_stack`) the rows are S seed-major
  blocks, ``generator`` is S generators, and each seed's stream advances exactly as in its solo
  run: every turn samples every row of a seed that still has an active episode (finished rows
  redraw from their prompt, their tokens discarded), and a seed with none draws from a scratch
  generator, as its solo run stops drawing;
* Search-R1 (arXiv 2503.09516) and ToRL (arXiv 2503.23383) mask the environment's tokens out of the
  loss; the mask returned here is what makes that possible.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcourse.lm import fast_gpt2
from rlcourse.lm.sampling import sample as default_sampler

__all__ = ["END_REASONS", "Episodes", "rollout"]

END_REASONS = ("answer", "malformed", "turns", "budget", "context")


@dataclass
class Episodes:
    """A batch of multi-turn episodes. B episodes, P prompt columns (left-padded), T completion columns.

    ``completion_mask[b, t]`` is 1 on every real completion token (policy and environment), 0 on
    the pads after it; ``policy_mask[b, t]`` is 1 on the tokens the policy sampled;
    ``logprobs[b, t]`` is the sampler's ``log pi(token | everything before it)`` at the sampling
    temperature on policy tokens, 0 elsewhere; ``turn_index[b, t]`` is the policy turn (0, 1, ...)
    that wrote the token or whose call the environment answered, -1 on pads.
    """

    prompt_ids: torch.Tensor        # (B, P) long
    prompt_mask: torch.Tensor       # (B, P) long
    completion_ids: torch.Tensor    # (B, T) long, <pad> after the episode
    completion_mask: torch.Tensor   # (B, T) long
    policy_mask: torch.Tensor       # (B, T) long
    logprobs: torch.Tensor          # (B, T) float
    turn_index: torch.Tensor        # (B, T) long
    turns: torch.Tensor             # (B,) long: policy turns taken
    tool_calls: torch.Tensor        # (B,) long: turns that ended with call_end (malformed calls included)
    rewards: torch.Tensor           # (B,) float: the final reward
    end_reasons: list[str] = field(default_factory=list)
    turn_rewards: list[list[float]] = field(default_factory=list)   # the environment's reward of each turn
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)            # completion text, observations included
    envs: list = field(default_factory=list)                        # the environment of each episode, after it

    @property
    def observation_mask(self) -> torch.Tensor:
        """(B, T): 1 on the tokens the environment wrote."""
        return self.completion_mask * (1 - self.policy_mask)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) tokens the policy wrote, ``policy_mask.sum(1)``: the length of a response (TRL counts
        ``sum(tool_mask)``), not its span ``completion_mask.sum(1)``, which includes the observations."""
        return self.policy_mask.sum(1)

    def select(self, rows: slice) -> "Episodes":
        """The episodes of ``rows`` (one seed's block of a seed-batched rollout)."""
        cut = {k: v[rows] for k, v in vars(self).items()}
        return Episodes(**cut)


def _one_token(tokenizer, text: str, name: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else []
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"{name} must be a string of exactly one known token, got {text!r}")
    return ids[0]


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], env_factory, *, max_turns: int = 4, max_turn_tokens: int = 8,
            max_completion_length: int = 32, temperature: float = 1.0, generator=None,
            sampler=None) -> Episodes:
    """Roll out one episode per prompt, alternating ``sampler`` and a fresh ``env_factory()`` per row.

    See the module docstring for the loop, the end reasons and the seed batching.

    Args:
        prompts: B prompt strings (S seed-major blocks of B / S on a seed-stacked model).
        env_factory: a callable returning a new environment (``reset``, ``step``, ``call_end``).
        max_turns: policy turns at most (TRL's ``max_tool_calling_iterations`` + 1).
        max_turn_tokens: tokens one turn may sample.
        max_completion_length: tokens after the prompt at most, policy and environment together.
        temperature: the sampling temperature (0 = greedy; log-probs then at temperature 1).
        generator: ``None``, a ``torch.Generator``, or S of them on a seed-stacked model.
        sampler: a function with :func:`rlcourse.lm.sample`'s signature (default: it).

    Returns:
        :class:`Episodes`, rows in the order of ``prompts``.
    """
    for name, value in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens),
                        ("max_completion_length", max_completion_length)):
        _positive(name, value)
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {type(prompts).__name__}")
    if not callable(env_factory):
        raise ValueError(f"env_factory must be a callable that returns a new environment, got {env_factory!r}")
    sampler = sampler or default_sampler
    seeds = fast_gpt2.num_seeds(model) or 1
    if len(prompts) % seeds:
        raise ValueError(f"a model stacking {seeds} seeds needs {seeds} equal blocks of prompts, got {len(prompts)}")
    dev = next(model.parameters()).device
    n_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    eos = tokenizer.eos_token_id
    B, size = len(prompts), len(prompts) // seeds

    envs = [env_factory() for _ in prompts]
    stop = _one_token(tokenizer, getattr(envs[0], "call_end", None), "the environment's call_end")
    starts = [p + (env.reset(p) or "") for p, env in zip(prompts, envs)]
    prompt_ids = [tokenizer(s)["input_ids"] for s in starts]
    texts = list(starts)                       # each episode's text so far
    ids = [[] for _ in prompts]                # completion tokens, policy and environment
    policy = [[] for _ in prompts]
    logps = [[] for _ in prompts]
    turn_of = [[] for _ in prompts]
    turns, calls, rewards = [0] * B, [0] * B, [0.0] * B
    reasons: list[str | None] = [None] * B
    turn_rewards = [[] for _ in prompts]

    def end(b: int, reason: str, reward: float = 0.0) -> None:
        reasons[b], rewards[b] = reason, reward

    for turn in range(max_turns):
        for b in range(B):      # a turn starts only if a whole turn fits in the context
            if reasons[b] is None and len(prompt_ids[b]) + len(ids[b]) + max_turn_tokens > n_positions:
                end(b, "context")
        active = [reasons[b] is None for b in range(B)]
        if not any(active):
            break
        seed_active = [any(active[s * size:(s + 1) * size]) for s in range(seeds)]
        gens = generator
        if isinstance(generator, (list, tuple)):    # a finished seed draws from scratch: its own stream stays put
            gens = [g if on else torch.Generator(device=g.device).manual_seed(0)
                    for g, on in zip(generator, seed_active)]
        roll = sampler(model, tokenizer, [texts[b] if active[b] else starts[b] for b in range(B)], max_turn_tokens,
                       temperature=temperature, generator=gens, stop_token_ids=[stop])
        for b in range(B):
            if not active[b]:
                continue
            held = roll.prompt_ids[b][roll.prompt_mask[b].bool()].tolist()
            if held != prompt_ids[b] + ids[b]:
                raise ValueError(f"the tokenizer re-encodes episode {b}'s text {texts[b]!r} into other tokens than "
                                 f"the episode holds: multi-turn rollouts need a tokenizer whose encoding of a "
                                 f"concatenation is the concatenation of the encodings (the course's character "
                                 f"tokenizer), or a sampler that takes token ids")
            real = roll.completion_mask[b].bool()
            new, new_lp = roll.completion_ids[b][real].tolist(), roll.logprobs[b][real].tolist()
            room = max_completion_length - len(ids[b])
            cut = len(new) > room
            new, new_lp = new[:room], new_lp[:room]
            ids[b] += new
            policy[b] += [1] * len(new)
            logps[b] += new_lp
            turn_of[b] += [turn] * len(new)
            turns[b] += 1
            ended_by = new[-1] if new and not cut else None
            turn_text = tokenizer.decode(new[:-1] if ended_by == eos else new, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            texts[b] += turn_text
            if ended_by not in (eos, stop):         # cut by the budget, or max_turn_tokens without an end
                end(b, "budget")
                continue
            calls[b] += int(ended_by == stop)
            observation, done, reward = envs[b].step(turn_text)
            reward = float(reward)
            turn_rewards[b].append(reward)
            obs_ids = tokenizer(observation, add_special_tokens=False)["input_ids"] if observation else []
            if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in obs_ids:
                raise ValueError(f"the environment's observation {observation!r} holds characters outside the "
                                 f"tokenizer's alphabet")
            fits_budget = len(ids[b]) + len(obs_ids) <= max_completion_length
            fits_context = len(prompt_ids[b]) + len(ids[b]) + len(obs_ids) <= n_positions
            if fits_budget and fits_context:
                ids[b] += obs_ids
                policy[b] += [0] * len(obs_ids)
                logps[b] += [0.0] * len(obs_ids)
                turn_of[b] += [turn] * len(obs_ids)
                texts[b] += observation
            if done:
                end(b, "answer" if ended_by == eos else "malformed", reward)
            elif not fits_context:
                end(b, "context")
            elif not fits_budget or len(ids[b]) == max_completion_length:
                end(b, "budget")
    for b in range(B):
        if reasons[b] is None:
            end(b, "turns")
    return _episodes(tokenizer, prompts, prompt_ids, ids, policy, logps, turn_of, turns, calls, rewards, reasons,
                     turn_rewards, texts, starts, envs, dev)


def _episodes(tokenizer, prompts, prompt_ids, ids, policy, logps, turn_of, turns, calls, rewards, reasons,
              turn_rewards, texts, starts, envs, dev) -> Episodes:
    """The lists of :func:`rollout`, as left-padded prompts and right-padded completions."""
    B, pad = len(prompts), tokenizer.pad_token_id
    P, T = max(len(p) for p in prompt_ids), max(1, max(len(c) for c in ids))
    out = dict(prompt_ids=torch.full((B, P), pad, dtype=torch.long), prompt_mask=torch.zeros(B, P, dtype=torch.long),
               completion_ids=torch.full((B, T), pad, dtype=torch.long),
               completion_mask=torch.zeros(B, T, dtype=torch.long), policy_mask=torch.zeros(B, T, dtype=torch.long),
               logprobs=torch.zeros(B, T), turn_index=torch.full((B, T), -1, dtype=torch.long))
    for b in range(B):
        p, n = len(prompt_ids[b]), len(ids[b])
        out["prompt_ids"][b, P - p:] = torch.tensor(prompt_ids[b])
        out["prompt_mask"][b, P - p:] = 1
        if n:
            out["completion_ids"][b, :n] = torch.tensor(ids[b])
            out["completion_mask"][b, :n] = 1
            out["policy_mask"][b, :n] = torch.tensor(policy[b])
            out["logprobs"][b, :n] = torch.tensor(logps[b])
            out["turn_index"][b, :n] = torch.tensor(turn_of[b])
    out = {k: v.to(dev) for k, v in out.items()}
    return Episodes(**out, turns=torch.tensor(turns, device=dev), tool_calls=torch.tensor(calls, device=dev),
                    rewards=torch.tensor(rewards, device=dev),
                    end_reasons=list(reasons), turn_rewards=turn_rewards, prompts=list(prompts),
                    completions=[t[len(s):] for t, s in zip(texts, starts)], envs=envs)
