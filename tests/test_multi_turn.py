"""Multi-turn rollouts (lesson 10e): the episode's tokens, masks and log-probs, the calculator
environment, bad input, and seed batching.

Oracles: a hand-written episode (its tokens and masks written out by hand); one fresh forward pass
over the whole episode (the log-probs the sampler stored, turn by turn, must equal it); each seed's
own model rolled out alone.
"""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import build_char_tokenizer, make_model, sample, sequence_logprobs
from rlcourse.lm.logprobs import completion_logits, token_logprobs_from_logits
from rlcourse.lm.multi_turn import END_REASONS, rollout
from rlcourse.lm.sampling import Rollout, encode_prompts
from rlcourse.lm.seed_stack import stack_models
from rlcourse.tasks.tool_env import ERROR_OBSERVATION, CalculatorEnv, ToolSumTask
from rlcourse.trainers.sft import encode_examples
from seed_helpers import perturbed_copies

TASK = ToolSumTask()
PROMPT = "12+34+56="


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return make_model("tiny", tok, seed=3).eval()


def scripted_sampler(script: dict):
    """A sampler that writes the turn ``script[episode text so far]`` (``"$"`` stands for ``<eos>``) and
    stores the model's log-probs of it, computed on that prefix alone (teacher forcing, one turn at a time)."""
    def sampler(model, tokenizer, prompts, max_new_tokens, temperature=1.0, generator=None, stop_token_ids=()):
        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
        turns = []
        for p in prompts:
            text = script.get(p, "$")
            ids = tokenizer(text.rstrip("$"), add_special_tokens=False)["input_ids"]
            turns.append((ids + [tokenizer.eos_token_id] * text.endswith("$"))[:max_new_tokens])
        width = max(len(t) for t in turns)
        completion = torch.full((len(prompts), width), tokenizer.pad_token_id)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, t in enumerate(turns):
            completion[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
        logp = sequence_logprobs(model, prompt_ids, completion, mask, prompt_mask, temperature=temperature or 1.0)
        return Rollout(prompt_ids, prompt_mask, completion, mask, logp, [], list(prompts), tokenizer.eos_token_id)
    return sampler


SCRIPT = {PROMPT: "(12+34)", PROMPT + "(12+34)=46;": "(46+56)", PROMPT + "(12+34)=46;(46+56)=102;": "102$"}


def fresh_logprobs(model, ep, temperature=1.0):
    logits = completion_logits(model, ep.prompt_ids, ep.completion_ids, ep.prompt_mask, ep.completion_mask)
    return token_logprobs_from_logits(logits, ep.completion_ids, temperature)


def test_the_hand_written_episode_tokens_masks_turns_and_logprobs(model, tok):
    ep = rollout(model, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT))
    text = "(12+34)=46;(46+56)=102;102"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    #          (12+34)            =46;         (46+56)             =102;            102<eos>
    policy = [1] * 7 + [0] * 4 + [1] * 7 + [0] * 5 + [1] * 4
    turn = [0] * 11 + [1] * 12 + [2] * 4
    assert ep.completion_ids[0].tolist() == ids
    assert ep.completion_mask[0].tolist() == [1] * len(ids)
    assert ep.policy_mask[0].tolist() == policy
    assert ep.observation_mask[0].tolist() == [1 - m for m in policy]
    assert ep.turn_index[0].tolist() == turn
    assert ep.prompt_ids[0].tolist() == tok(PROMPT)["input_ids"]
    assert (ep.turns.tolist(), ep.tool_calls.tolist(), ep.end_reasons) == ([3], [2], ["answer"])
    assert ep.rewards.tolist() == [1.0] and ep.turn_rewards == [[1.0, 1.0, 1.0]]
    assert ep.completions == [text] and ep.response_lengths.tolist() == [18]
    # the log-probs stored turn by turn equal one fresh forward pass over the whole episode
    fresh = fresh_logprobs(model, ep)
    pol = ep.policy_mask.bool()
    assert torch.allclose(ep.logprobs[pol], fresh[pol], atol=1e-5)
    assert bool((ep.logprobs[~pol] == 0).all())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_episodes_logprobs_equal_a_fresh_forward_pass(tok, temperature):
    model = make_model("tiny", tok, seed=5).eval()
    prompts = TASK.prompts(12, rng=0)
    ep = rollout(model, tok, prompts, TASK.make_env, temperature=temperature, max_turns=3,
                 generator=torch.Generator().manual_seed(0))
    fresh = fresh_logprobs(model, ep, temperature)
    pol = ep.policy_mask.bool()
    assert torch.allclose(ep.logprobs[pol], fresh[pol], atol=1e-5)
    assert set(ep.end_reasons) <= set(END_REASONS)
    assert bool((ep.policy_mask <= ep.completion_mask).all())
    # the episode is one sequence: completion tokens end where the mask ends
    assert bool((ep.completion_mask[:, 1:] <= ep.completion_mask[:, :-1]).all())


def test_a_malformed_call_gets_an_error_observation_and_ends_the_episode(model, tok):
    script = {PROMPT: "(12+34+56)"}
    ep = rollout(model, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(script), max_turn_tokens=12)
    assert ep.end_reasons == ["malformed"] and ep.rewards.tolist() == [0.0]
    assert ep.completions == ["(12+34+56)" + ERROR_OBSERVATION]
    assert ep.policy_mask[0].tolist() == [1] * 10 + [0] * 3
    for bad in ("(1a+2)", ")", "(+)", "((1+2)", "(1+2+)", "(12-3)"):
        env = TASK.make_env()
        env.reset(PROMPT)
        assert env.step(bad) == (ERROR_OBSERVATION, True, 0.0), bad


def test_budget_turns_and_context_end_an_episode_with_a_stated_reason(tok):
    m = make_model("tiny", tok, seed=1).eval()
    # budget: the second call is cut mid-way; the tokens past the budget are dropped
    ep = rollout(m, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT), max_completion_length=14)
    assert ep.end_reasons == ["budget"] and ep.completions == ["(12+34)=46;(46"] and ep.rewards.tolist() == [0.0]
    # an observation that would pass the budget is not appended
    ep = rollout(m, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT), max_completion_length=9)
    assert ep.end_reasons == ["budget"] and ep.completions == ["(12+34)"]
    # a turn that writes max_turn_tokens tokens without ending
    ep = rollout(m, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler({PROMPT: "1234567"}), max_turn_tokens=4)
    assert ep.end_reasons == ["budget"] and ep.completions == ["1234"]
    # max_turns: two calls and no room for the answer
    ep = rollout(m, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT), max_turns=2)
    assert ep.end_reasons == ["turns"] and ep.turns.tolist() == [2] and ep.rewards.tolist() == [0.0]
    # context: 10 prompt + 7 call + 4 observation = 21 positions; the observation does not fit in 20
    short = make_model("tiny", tok, seed=1, n_positions=20).eval()
    ep = rollout(short, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT), max_turn_tokens=7)
    assert ep.end_reasons == ["context"] and ep.completions == ["(12+34)"]
    # ... and a turn starts only where max_turn_tokens more fit
    ep = rollout(short, tok, [PROMPT], TASK.make_env, sampler=scripted_sampler(SCRIPT), max_turn_tokens=11)
    assert ep.end_reasons == ["context"] and ep.turns.tolist() == [0] and ep.completion_mask.sum() == 0


def test_bad_arguments_are_refused_with_a_sentence(model, tok):
    env = TASK.make_env
    for kwargs, words in ((dict(max_turns=0), "max_turns"), (dict(max_turn_tokens=1.5), "max_turn_tokens"),
                          (dict(max_completion_length=-1), "max_completion_length")):
        with pytest.raises(ValueError, match=words):
            rollout(model, tok, [PROMPT], env, **kwargs)
    with pytest.raises(ValueError, match="list of strings"):
        rollout(model, tok, PROMPT, env)
    with pytest.raises(ValueError, match="env_factory"):
        rollout(model, tok, [PROMPT], None)

    class TwoCharCall(CalculatorEnv):
        call_end = ")("
    with pytest.raises(ValueError, match="call_end"):
        rollout(model, tok, [PROMPT], lambda: TwoCharCall(TASK.operands))

    class Unicode(CalculatorEnv):
        def step(self, text):
            return "=\u00e9;", False, 0.0
    with pytest.raises(ValueError, match="alphabet"):
        rollout(model, tok, [PROMPT], lambda: Unicode(TASK.operands), sampler=scripted_sampler(SCRIPT))

    def drifting(model, tokenizer, prompts, *args, **kwargs):   # a tokenizer that re-encodes a text otherwise
        roll = scripted_sampler(SCRIPT)(model, tokenizer, prompts, *args, **kwargs)
        roll.prompt_ids = roll.prompt_ids.clone()
        roll.prompt_ids[:, -1] = tokenizer.convert_tokens_to_ids("7")
        return roll
    with pytest.raises(ValueError, match="re-encodes"):
        rollout(model, tok, [PROMPT], env, sampler=drifting)


def test_the_calculator_environment(tok):
    env = TASK.make_env()
    assert env.reset(PROMPT) == ""
    assert env.step("(12+34)") == ("=46;", False, 1.0)        # a correct intermediate
    assert env.step("(12+34)") == ("=46;", False, 0.0)        # the same again earns nothing
    assert env.step("(1+2)") == ("=3;", False, 0.0)           # not a sum of the prompt's numbers
    assert env.step("(46+56)") == ("=102;", False, 1.0)
    assert env.step("102") == ("", True, 1.0) and env.calls == 4 and not env.malformed
    env.reset(PROMPT)
    assert env.step("101") == ("", True, 0.0) and env.calls == 0
    off = TASK.make_env(tool_enabled=False)
    off.reset(PROMPT)
    assert off.step("(12+34)") == ("", False, 1.0)
    off.step("=46;(46+56)")
    assert off.hallucinated
    with pytest.raises(ValueError, match="model_text"):
        env.step(None)


def test_the_task_and_its_demonstrations(tok):
    text, spans = TASK.tool_trace(PROMPT)
    assert (text, spans) == ("(12+34)=46;(46+56)=102;102", [(7, 11), (18, 23)])
    assert [text[a:b] for a, b in spans] == ["=46;", "=102;"]
    assert TASK.answer(PROMPT) == "102" and TASK.reward([PROMPT, PROMPT], ["102", "(1"]).tolist() == [1.0, 0.0]
    test = set(TASK.test_prompts(200))
    assert not test & set(TASK.prompts(2000, rng=0)) and TASK.test_prompts(5) == TASK.test_prompts(5)
    data = ToolSumTask(tool_rate=0.5).sft_dataset(400, rng=0)
    traces = [d for d in data if d["observation_spans"]]
    assert 0.25 < len(traces) / len(data) < 0.45
    # SFT leaves the environment's tokens out of its loss
    ids, _, loss_mask = encode_examples(tok, [{"prompt": PROMPT, "completion": text, "observation_spans": spans}])
    completion = loss_mask[0, -27:].tolist()
    assert completion == [1] * 7 + [0] * 4 + [1] * 7 + [0] * 5 + [1] * 3 + [1]   # ... + <eos>
    plain = encode_examples(tok, [{"prompt": PROMPT, "completion": text}])
    assert torch.equal(plain[0], ids) and plain[2].sum() == 27
    with pytest.raises(ValueError, match="observation_spans"):
        encode_examples(tok, [{"prompt": PROMPT, "completion": text, "observation_spans": [(7, 40)]}])
    for bad in ("12+34", "a+b=", ""):
        with pytest.raises(ValueError, match="prompt"):
            TASK.operands(bad)


def test_sample_stops_at_a_stop_token_and_keeps_it(model, tok):
    stop = tok.convert_tokens_to_ids(")")
    roll = sample(model, tok, [PROMPT] * 16, 20, generator=torch.Generator().manual_seed(0), stop_token_ids=[stop])
    for ids, mask in zip(roll.completion_ids.tolist(), roll.completion_mask.tolist()):
        real = [t for t, m in zip(ids, mask) if m]
        ends = [i for i, t in enumerate(real) if t in (stop, tok.eos_token_id)]
        assert ends in ([], [len(real) - 1])
    with pytest.raises(ValueError, match="stop_token_ids"):
        sample(model, tok, [PROMPT], 4, stop_token_ids=[10_000])


def test_seed_batched_rollouts_equal_each_seeds_solo_rollout(tok):
    base = make_model("tiny", tok, seed=2)
    models = perturbed_copies(base, [0, 1], scale=0.3)
    stack = stack_models(models)
    blocks = [TASK.prompts(6, rng=s) for s in (0, 1)]
    gens = [torch.Generator().manual_seed(10 + s) for s in (0, 1)]
    ep = rollout(stack, tok, blocks[0] + blocks[1], TASK.make_env, generator=gens)
    for s, m in enumerate(models):
        g = torch.Generator().manual_seed(10 + s)
        alone = rollout(m, tok, blocks[s], TASK.make_env, generator=g)
        mine = ep.select(slice(6 * s, 6 * s + 6))
        assert mine.completions == alone.completions and mine.end_reasons == alone.end_reasons
        T = alone.completion_ids.shape[1]
        assert torch.equal(mine.policy_mask[:, :T], alone.policy_mask)
        assert torch.allclose(mine.logprobs[:, :T], alone.logprobs, atol=1e-5)
        # the stream stands where the solo run left it
        assert torch.equal(torch.rand(3, generator=gens[s]), torch.rand(3, generator=g))
