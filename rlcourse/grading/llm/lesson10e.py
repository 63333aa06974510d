"""Checks for lesson 10e (multi-turn RL with tools).

* :func:`check_policy_mask` - the policy mask of episodes given as the lengths of their pieces
  (mistakes caught: the mask inverted, every real token kept, the padding kept, the first token of
  each observation kept, the last token of each turn dropped, the observations not counted when
  placing the turns, only the first turn kept);
* :func:`check_episode_logprobs` - the log-prob of every policy token from one forward pass over the
  whole episode, equal to what the sampler stored turn by turn (mistakes caught: no shift between
  logits and tokens, positions counted from the padding, the temperature left out, the environment's
  tokens left in, the log-softmax summed or taken at the argmax, probabilities for log-probs, no graph);
* :func:`check_multi_turn_step` - one GRPO step on episodes, with the environment's tokens masked or
  not, checked by the gradient it hands the optimiser, then by a short training run from
  ``tool-sum-sft`` that must raise held-out exact match;
* :func:`check_multi_turn_update` - find the bug: an update whose mask is one token off, so that it
  trains the first token of every observation and never the first token of a turn; fixed, its
  gradient equals the reference's and its training teaches the model to call the calculator.
"""
from __future__ import annotations

import functools

import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references
from rlcourse.grading._routes import MULTI_TURN, POLICY_GRADIENT_LOSSES

__all__ = ["check_policy_mask", "check_episode_logprobs", "check_multi_turn_step", "check_multi_turn_update"]


# ---------------------------------------------------------------------------- exercise 1: the policy mask
def _mask_cases():
    import numpy as np

    cases = [("the hand-written episode: call, observation, call, observation, answer", [[7, 4, 7, 5, 4]], 27),
             ("a direct answer, padded", [[4], [2]], 6),
             ("episodes of one, two and three turns, one cut after a call", [[3, 2, 1], [2, 3], [5, 4, 6, 4, 2]], 24),
             ("an empty turn and an empty observation", [[0, 3, 4], [2, 0, 2]], 9)]
    rng = np.random.default_rng(101)
    segments = []
    for _ in range(6):
        turns = int(rng.integers(1, 5))
        pieces = []
        for k in range(turns):
            pieces.append(int(rng.integers(1, 9)))
            if k < turns - 1 or rng.random() < 0.3:
                pieces.append(int(rng.integers(2, 6)))
        segments.append(pieces)
    cases.append(("six seeded episodes", segments, max(sum(s) for s in segments) + 3))
    return cases


def _mask_mistakes(segments, width):
    """(mask, hint) of the usual slips, computed from the segments."""
    from rlcourse.losses.multi_turn import policy_mask_from_segments

    right = policy_mask_from_segments(segments, width)
    real = torch.zeros_like(right)
    for b, pieces in enumerate(segments):
        real[b, :sum(pieces)] = 1
    first_obs = right.clone()
    first_obs[:, 1:] |= right[:, :-1] & real[:, 1:]
    last_dropped = right.clone()
    last_dropped[:, :-1] &= right[:, 1:]
    last_dropped[:, -1] = 0
    contiguous, only_first = torch.zeros_like(right), torch.zeros_like(right)
    for b, pieces in enumerate(segments):
        contiguous[b, :sum(pieces[0::2])] = 1
        only_first[b, :pieces[0] if pieces else 0] = 1
    return [(real - right, "that is the observation mask: the policy mask is 1 on the tokens the policy wrote "
                           "(the even pieces, counted from 0) and 0 on the environment's"),
            (1 - right, "1 where the policy wrote and 0 elsewhere, the padding after the episode included"),
            (real, "the environment's pieces (the odd ones) are observations: 0 there"),
            (right | (1 - real), "the padding after the episode is not the policy's: 0 there"),
            (first_obs, "off by one: the first token of each observation is marked as the policy's. Each piece "
                        "starts where the previous one ended"),
            (last_dropped, "off by one: the last token of each turn (the call's ')' or <eos>) is the policy's too"),
            (contiguous, "advance past the observations too: each piece starts where the previous one ended, "
                         "whoever wrote it"),
            (only_first, "every policy turn counts, not only the first")]


@references("rlcourse.losses.multi_turn:policy_mask_from_segments")
def check_policy_mask(fn) -> None:
    """``fn(segments, width) -> (B, width)``: 1 on the tokens the policy wrote, 0 on the environment's and on
    the padding. ``segments[b]`` lists episode ``b``'s piece lengths, ``[policy, observation, policy, ...]``."""
    __tracebackhide__ = True
    from rlcourse.losses.multi_turn import policy_mask_from_segments

    name = "check_policy_mask"
    n = 0
    for case, segments, width in _mask_cases():
        got = call_unmutated(name, case, fn, segments, width)
        expected = policy_mask_from_segments(segments, width)
        for mistake, hint in _mask_mistakes(segments, width):
            fail_if_mistake(name, case, expected, got, mistake, hint)
        assert_close(name, f"{case}, segments {segments}, width {width}", expected, got, atol=0, rtol=0,
                     hint="1 on the policy's pieces (the even ones), 0 on the observations and on the padding after")
        n += 1
    passed(name, n)


# ------------------------------------------------------------------ exercise 2: log-probs over the episode
def _tool_start():
    """``(task, model, tokenizer)``: the tool task and a moved copy of ``tool-sum-sft`` in eval mode."""
    from rlcourse.grading._steps import moved_copy
    from rlcourse.lm import load_checkpoint
    from rlcourse.tasks.tool_env import ToolSumTask

    model, tokenizer = load_checkpoint("tool-sum-sft", device="cpu")
    return ToolSumTask(), moved_copy(model, seed=7, scale=0.01).eval(), tokenizer


def _episodes(model, tokenizer, task, temperature, seed, n=48):
    """Sampled episodes, some with calls, from prompts of different lengths (left padding)."""
    from rlcourse.lm.multi_turn import rollout

    prompts = task.prompts(n, rng=seed)
    return rollout(model, tokenizer, prompts, task.make_env, temperature=temperature,
                   generator=torch.Generator().manual_seed(seed))


def _logprob_mistakes(model, ep, temperature):
    """(log-probs, hint) of the usual slips, from one forward pass each."""
    import torch.nn.functional as F

    from rlcourse.lm.logprobs import position_ids_from_mask

    P = ep.prompt_ids.shape[1]
    ids = torch.cat([ep.prompt_ids, ep.completion_ids], 1)
    attention = torch.cat([ep.prompt_mask, ep.completion_mask], 1)
    policy = ep.policy_mask.bool()
    zero = torch.zeros(ep.completion_ids.shape, dtype=torch.float32)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
        plain = model(input_ids=ids, attention_mask=attention).logits
        for lg, hint, shift, temp, keep in (
                (logits, "no shift: the logits at column j predict token j + 1, so a completion token's log-prob is "
                         "read from the column before it", 0, temperature, policy),
                (plain, "left padding: positions count from each row's first real token (cumsum of the attention "
                        "mask - 1), or GPT-2 reads every padded row at the wrong positions", 1, temperature, policy),
                (logits, "divide the logits by the temperature the episodes were sampled at", 1, 1.0, policy),
                (logits, "the environment's tokens were not sampled: their log-prob is 0 (only the policy mask's "
                         "tokens)", 1, temperature, ep.completion_mask.bool())):
            window = lg[:, P - shift:P - shift + ep.completion_ids.shape[1]].float() / temp
            logp = F.log_softmax(window, -1).gather(-1, ep.completion_ids[..., None]).squeeze(-1)
            out.append((torch.where(keep, logp, zero), hint))
        window = logits[:, P - 1:P - 1 + ep.completion_ids.shape[1]].float() / temperature
        every = F.log_softmax(window, -1)
        out.append((torch.where(policy, every.sum(-1), zero), "the log-prob of the token taken: gather it from the "
                    "log-softmax, do not sum over the vocabulary"))
        out.append((torch.where(policy, every.max(-1).values, zero), "the log-prob of the token the episode holds, "
                    "not of the most likely one"))
        right = torch.where(policy, every.gather(-1, ep.completion_ids[..., None]).squeeze(-1), zero)
        out.append((torch.where(policy, right.exp(), zero), "log-probs, not probabilities"))
    return out


@references("rlcourse.lm.logprobs:completion_logits", "rlcourse.lm.logprobs:sequence_logprobs",
            "rlcourse.lm.logprobs:token_logprobs_from_logits", "rlcourse.lm.logprobs:next_token_logprobs",
            "rlcourse.lm.fast_gpt2:completion_window_logits", *MULTI_TURN)
def check_episode_logprobs(fn) -> None:
    """``fn(model, prompt_ids, prompt_mask, completion_ids, completion_mask, policy_mask, temperature) -> (B, T)``:
    from one forward pass over ``[prompt | completion]``, each policy token's log-prob at ``temperature``, 0 on the
    environment's tokens and the padding, with the model's graph. Compared with the log-probs the sampler stored
    turn by turn, on episodes with calls and left-padded prompts of different lengths."""
    __tracebackhide__ = True
    name = "check_episode_logprobs"
    task, model, tokenizer = _tool_start()
    n = 0
    for temperature, seed in ((1.0, 11), (0.8, 12), (1.3, 13)):
        ep = _episodes(model, tokenizer, task, temperature, seed)
        case = (f"{len(ep.prompts)} episodes at temperature {temperature} ({int(ep.tool_calls.sum())} calls, "
                f"prompts of {sorted(set(len(p) for p in ep.prompts))} characters)")
        args = (ep.prompt_ids, ep.prompt_mask, ep.completion_ids, ep.completion_mask, ep.policy_mask)
        got = call_unmutated(name, case, fn, model, *args, temperature)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(ep.completion_ids.shape):
            fail(name, case, f"a tensor of shape {tuple(ep.completion_ids.shape)}: one log-prob per completion token",
                 getattr(got, "shape", type(got).__name__), "return the (B, T) log-probs of the completion's tokens")
        if got.grad_fn is None:
            fail(name, case, "log-probs that carry the model's graph (a grad_fn)", "a tensor without a graph",
                 "compute them with the model's forward, outside torch.no_grad(), without .detach(): a training step "
                 "differentiates them")
        expected = ep.logprobs
        for mistake, hint in _logprob_mistakes(model, ep, temperature):
            if float((mistake - expected).abs().max()) > 1e-3:     # a slip this case can tell from the right answer
                fail_if_mistake(name, case, expected, got.detach(), mistake, hint)
        assert_close(name, case, expected, got.detach(), atol=1e-4, rtol=0,
                     hint="the log-prob of each policy token given everything before it, 0 elsewhere")
        n += 1
    passed(name, n)


# ----------------------------------------------------------------- exercise 3: a GRPO step on episodes
def _reference_step(model, optimizer, tokenizer, task, prompts, generator, num_generations, mask_observations=True):
    """The reference step: a group of episodes per prompt, GRPO's group advantage of the environment's final
    reward, the clipped loss (epsilon 0.2) averaged over the policy's tokens (``mask_observations``) or over
    every completion token, one update. Returns the mean reward."""
    from rlcourse.lm import sequence_logprobs
    from rlcourse.lm.multi_turn import rollout
    from rlcourse.losses.grpo import aggregate_loss, group_advantages, per_token_loss

    group = [p for p in prompts for _ in range(num_generations)]
    ep = rollout(model, tokenizer, group, task.make_env, generator=generator)
    advantages = group_advantages(ep.rewards, num_generations)
    logp = sequence_logprobs(model, ep.prompt_ids, ep.completion_ids, ep.completion_mask, ep.prompt_mask)
    mask = ep.policy_mask if mask_observations else ep.completion_mask
    loss = aggregate_loss(per_token_loss(logp, logp.detach(), advantages, mask, "dapo", 0.2), mask, "dapo")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(ep.rewards.mean())


STEP_SETTINGS = [("mask_observations=True", 6, 4, True), ("mask_observations=False", 6, 4, False),
                 ("mask_observations=True", 4, 8, True)]
STEP_LEARNING = {"steps": 40, "lr": 2e-4, "groups": 8, "num_generations": 8, "held_out": 200, "margin": 0.1}
_SPAN = ("the right direction at another length: DAPO's token mean divides by the number of tokens that learn "
         "(mask.sum() of the loss mask), not by the episode's span, which counts the environment's tokens too")


def _train_from_tool_sum(step, learning) -> tuple[float, float, float, list]:
    """Train ``tool-sum-sft`` with ``learning["steps"]`` calls of ``step(model, optimizer, tokenizer, task, prompts,
    generator)`` (Adam); greedy exact match before and after on held-out prompts, the tool-call rate after, and
    what each call returned."""
    import numpy as np

    from rlcourse.lm import load_checkpoint
    from rlcourse.tasks.tool_env import ToolSumTask
    from rlcourse.trainers.multi_turn import evaluate_tool_use

    task = ToolSumTask()
    model, tokenizer = load_checkpoint("tool-sum-sft", device="cpu")
    prompts = task.test_prompts(learning["held_out"])
    before = evaluate_tool_use(model, tokenizer, task, prompts)[0]["reward"]
    optimizer = torch.optim.Adam(model.parameters(), lr=learning["lr"])
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    returned = [step(model, optimizer, tokenizer, task, task.prompts(learning["groups"], rng), gen)
                for _ in range(learning["steps"])]
    after = evaluate_tool_use(model.eval(), tokenizer, task, prompts)[0]
    return before, after["reward"], after["tool_call_rate"], returned


@functools.lru_cache(maxsize=1)
def _caller_start():
    """``(task, model, tokenizer)``: ``tool-sum-sft`` after 15 steps of masked GRPO (the course's trainer), a policy
    that calls the calculator in about half its sampled episodes, so that a batch holds many observations and
    groups whose rewards differ. Built once per process (a few seconds)."""
    from rlcourse.lm import load_checkpoint
    from rlcourse.tasks.tool_env import ToolSumTask
    from rlcourse.trainers.multi_turn import MultiTurnConfig, MultiTurnTrainer

    task = ToolSumTask()
    model, tokenizer = load_checkpoint("tool-sum-sft", device="cpu")
    trainer = MultiTurnTrainer(model, tokenizer, task, MultiTurnConfig(learning_rate=2e-4, max_grad_norm=None, seed=0))
    trainer.train(15, progress=False)
    return task, trainer.model_of(0).eval(), tokenizer


def _compare_steps(name, fn, reference, settings, otherwise, longer):
    """Two calls of ``fn`` and of ``reference`` per setting from the same weights and generator seed: the same
    mean reward and the same gradient at each call. The start calls the calculator often (:func:`_caller_start`)."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import assert_call_gradient, twin_runs

    task, start, tokenizer = _caller_start()
    n = 0
    for case, n_prompts, K, *extra in settings:
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.02)
        gen_mine, gen_theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for call in (0, 1):
            prompts = task.prompts(n_prompts, rng=30 + call)
            reward = fn(mine, opt_mine, tokenizer, task, list(prompts), gen_mine, K, *extra)
            expected_reward = reference(theirs, opt_theirs, tokenizer, task, prompts, gen_theirs, K, *extra)
            label = f"{case}, {n_prompts} prompts x {K} episodes, call {call + 1}"
            if reward is None or abs(float(reward) - expected_reward) > 1e-6:
                fail(name, label, f"mean final reward {expected_reward:.4f} of the episodes drawn", reward,
                     "roll out once per call, each prompt num_generations times in a row, with rollout(model, tokenizer, "
                     "group, task.make_env, generator=generator); return the mean of episodes.rewards")
            assert_call_gradient(name, label, call, opt_mine, opt_theirs, otherwise, longer=longer)
            n += 1
    return n


@references(*POLICY_GRADIENT_LOSSES, *MULTI_TURN)
def check_multi_turn_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, mask_observations) -> mean reward``:
    one GRPO update on episodes. The gradient of each of two calls equals the reference step's (same weights and
    generator), with the environment's tokens masked and not; then 40 steps from ``tool-sum-sft`` must raise held-out
    greedy exact match by 8 points."""
    __tracebackhide__ = True
    import numpy as np

    name = "check_multi_turn_step"
    n = _compare_steps(name, fn, _reference_step, STEP_SETTINGS,
                       "another direction: the advantage is GRPO's, within each group of num_generations episodes, of "
                       "the final reward; the tokens that learn are the policy mask's when mask_observations is True "
                       "and every completion token otherwise", _SPAN)
    s = STEP_LEARNING

    def step(model, optimizer, tokenizer, task, prompts, generator):
        return float(fn(model, optimizer, tokenizer, task, prompts, generator, s["num_generations"], True))

    before, after, calls, rewards = _train_from_tool_sum(step, s)
    if not after >= before + s["margin"]:
        fail(name, f"{s['steps']} steps of your step (Adam, lr {s['lr']}, {s['groups']} prompts x {s['num_generations']})",
             f"held-out exact match at least {before + s['margin']:.3f} (from {before:.3f})", f"{after:.3f}",
             f"the mean reward of the training batches went {np.mean(rewards[:5]):.3f} -> {np.mean(rewards[-5:]):.3f}")
    print(f"✔ {name}: all {n} cases passed; {s['steps']} steps raised held-out exact match {before:.3f} -> {after:.3f} "
          f"(greedy tool-call rate {calls:.2f})")


# --------------------------------------------------------------------- exercise 4: find the bug, fixed
BUG_SETTINGS = [("", 6, 4), ("", 4, 8)]
BUG_LEARNING = {"steps": 30, "lr": 2e-4, "groups": 8, "num_generations": 8, "held_out": 200, "calls": 0.5}


@references(*POLICY_GRADIENT_LOSSES, *MULTI_TURN)
def check_multi_turn_update(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations) -> mean reward``: the fixed
    find-the-bug update. Its gradient equals the reference step's (the policy's tokens only, each log-prob
    aligned with its token) on two calls of two settings; then 30 steps from ``tool-sum-sft`` must teach the
    greedy policy to call the calculator on at least half the held-out prompts."""
    __tracebackhide__ = True
    name = "check_multi_turn_update"
    n = _compare_steps(name, fn, _reference_step, [(f"{p} prompts x {k} episodes", p, k) for _, p, k in BUG_SETTINGS],
                       "another direction: the loss mask must sit on the tokens whose log-probs it selects. logp[:, j] "
                       "is the log-prob of token j + 1, so its mask is that of token j + 1", _SPAN)
    s = BUG_LEARNING

    def step(model, optimizer, tokenizer, task, prompts, generator):
        return float(fn(model, optimizer, tokenizer, task, prompts, generator, s["num_generations"]))

    before, after, calls, _ = _train_from_tool_sum(step, s)
    if calls < s["calls"]:
        fail(name, f"{s['steps']} steps of your update", f"a greedy tool-call rate of at least {s['calls']}",
             f"{calls:.2f}", "the first token of a turn decides whether to call: a mask one token off never trains it")
    print(f"✔ {name}: all {n} cases passed; {s['steps']} steps: greedy tool-call rate {calls:.2f}, exact match "
          f"{before:.3f} -> {after:.3f}")
