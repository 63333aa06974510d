"""The DPO trainer: encoding, log-probs that agree with the sampler, TRL's metric names, the reference."""
import copy
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import build_char_tokenizer, load_checkpoint, sample, sequence_logprobs
from rlcourse.trainers.dpo import (DPOConfig, select_pairs, check_preference_pairs, pair_token_logprobs, reward_and_kl,
                             train_dpo)
from rlcourse.tasks.reward_model import encode_preference_pairs

PAIRS = [{"prompt": "ab:", "chosen": "abba", "rejected": "h"},
         {"prompt": "ce:", "chosen": "cd", "rejected": "hgfeh"},
         {"prompt": "hh:", "chosen": "hhgh", "rejected": "aa"}]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("preference-sft", device="cpu")


def test_encoding_pads_prompts_left_and_completions_right_with_eos(checkpoint):
    _, tok = checkpoint
    batch = select_pairs(encode_preference_pairs(tok, PAIRS), torch.arange(3))
    assert batch["prompt_ids"].shape == (6, 4)                 # <bos> + 3 characters, chosen then rejected
    assert batch["completion_ids"].shape == (6, 6)             # longest: "hgfeh" + <eos>
    assert batch["completion_mask"].sum(1).tolist() == [5, 3, 5, 2, 6, 3]
    ends = batch["completion_mask"].sum(1) - 1
    assert torch.all(batch["completion_ids"][torch.arange(6), ends] == tok.eos_token_id)
    assert torch.all(batch["completion_ids"][batch["completion_mask"] == 0] == tok.pad_token_id)
    one = select_pairs(encode_preference_pairs(tok, PAIRS), torch.tensor([2]))   # "hhgh" vs "aa": 5 columns
    assert one["completion_ids"].shape == (2, 5)


def test_pair_logprobs_equal_one_pair_at_a_time(checkpoint):
    """Padding (prompt and completion) changes nothing: batched log-probs equal unpadded ones."""
    model, tok = checkpoint
    with torch.no_grad():
        chosen, rejected = pair_token_logprobs(model, select_pairs(encode_preference_pairs(tok, PAIRS), torch.arange(3)))
        for i, row in enumerate(PAIRS):
            c1, r1 = pair_token_logprobs(model, select_pairs(encode_preference_pairs(tok, [row]), torch.arange(1)))
            assert torch.allclose(chosen[i].sum(), c1.sum(), atol=1e-5)
            assert torch.allclose(rejected[i].sum(), r1.sum(), atol=1e-5)


def test_pair_logprobs_equal_the_samplers(checkpoint):
    model, tok = checkpoint
    roll = sample(model, tok, ["ab:", "ce:", "hh:"], 8, generator=torch.Generator().manual_seed(0))
    pairs = [{"prompt": p, "chosen": c, "rejected": "a"} for p, c in zip(roll.prompts, roll.completions)]
    with torch.no_grad():
        chosen, _ = pair_token_logprobs(model, select_pairs(encode_preference_pairs(tok, pairs), torch.arange(3)))
    finished = roll.finished
    assert torch.allclose(chosen.sum(-1)[finished], roll.logprobs.sum(-1)[finished], atol=1e-5)


def test_first_step_sees_the_reference_and_training_raises_the_margin(checkpoint):
    model, tok = copy.deepcopy(checkpoint[0]), checkpoint[1]
    ref = copy.deepcopy(model)
    pairs = PreferenceTask().preference_pairs(64, rng=0)
    h = train_dpo(model, tok, pairs, DPOConfig(beta=0.1, learning_rate=1e-3, per_device_train_batch_size=16,
                                               max_steps=12), progress=False)
    names = {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
             "logps/chosen", "logps/rejected", "learning_rate", "step"}
    assert names <= set(h)
    assert h["loss"][0] == pytest.approx(math.log(2), abs=1e-5)       # policy == reference at step 1
    assert h["rewards/chosen"][0] == pytest.approx(0.0, abs=1e-6)
    assert sum(h["rewards/margins"][-4:]) / 4 > 0.05
    assert h["learning_rate"][0] == pytest.approx(1e-3) and h["learning_rate"][-1] < 1e-4   # linear decay
    # the policy moved, the reference (a copy made by the trainer) did not touch the original
    moved = any(not torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert moved


def test_precomputed_reference_gives_the_same_run(checkpoint):
    tok = checkpoint[1]
    pairs = PreferenceTask().preference_pairs(40, rng=1)
    runs = []
    for precompute in (False, True):
        model = copy.deepcopy(checkpoint[0])
        ref = copy.deepcopy(checkpoint[0])
        cfg = DPOConfig(beta=0.2, learning_rate=1e-3, per_device_train_batch_size=8, max_steps=5,
                        precompute_ref_log_probs=precompute, loss_type=["sigmoid", "sft"])
        runs.append(train_dpo(model, tok, pairs, cfg, ref_model=ref, progress=False))
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], abs=1e-5)
    assert runs[0]["rewards/margins"] == pytest.approx(runs[1]["rewards/margins"], abs=1e-5)


def test_reference_model_is_left_unchanged(checkpoint):
    model, tok = copy.deepcopy(checkpoint[0]), checkpoint[1]
    ref = copy.deepcopy(checkpoint[0])
    before = [p.clone() for p in ref.parameters()]
    train_dpo(model, tok, PAIRS, DPOConfig(max_steps=3, learning_rate=1e-3, loss_type="ipo"), ref_model=ref,
              progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters()))
    assert all(p.requires_grad for p in model.parameters())


def test_any_causal_lm_trains():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer("abcdefgh:")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    h = train_dpo(llama, tok, PAIRS * 4, DPOConfig(beta=0.5, learning_rate=3e-3, per_device_train_batch_size=12,
                                                   max_steps=15, lr_scheduler_type="constant"), progress=False)
    assert h["rewards/margins"][-1] > h["rewards/margins"][0] + 0.5
    assert h["rewards/accuracies"][-1] == 1.0


def test_reward_and_kl_is_zero_kl_against_itself(checkpoint):
    model, tok = checkpoint
    task = PreferenceTask()
    gold, kl = reward_and_kl(model, model, tok, task, task.test_prompts(16), generator=torch.Generator().manual_seed(0))
    assert kl == pytest.approx(0.0, abs=1e-6)
    assert -1.0 <= gold <= 1.0


@pytest.mark.parametrize("kwargs, match", [({"beta": 0.0}, "beta"), ({"loss_type": "dpo"}, "loss_type"),
                                           ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights"),
                                           ({"label_smoothing": 0.5}, "label_smoothing"),
                                           ({"per_device_train_batch_size": 0}, "batch_size"),
                                           ({"lr_scheduler_type": "cosine"}, "lr_scheduler_type"),
                                           ({"max_steps": 0}, "max_steps")])
def test_bad_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOConfig(**kwargs)


def test_bad_pairs_are_named(checkpoint):
    _, tok = checkpoint
    with pytest.raises(ValueError, match="non-empty"):
        check_preference_pairs(tok, [])
    with pytest.raises(ValueError, match=r"pairs\[0\]"):
        check_preference_pairs(tok, [{"prompt": "ab:", "chosen": "a"}])
    with pytest.raises(ValueError, match="outside"):
        check_preference_pairs(tok, [{"prompt": "ab:", "chosen": "a", "rejected": "€"}])


def test_reward_and_kl_agrees_with_the_plain_log_ratio_estimate(checkpoint):
    """The chain-rule KL (exact per-token KL summed along samples) and the unbiased sequence
    log-ratio k1 estimate the same KL(pi || pi_ref): they agree within the latter's noise."""
    ref, tok = checkpoint
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    task = PreferenceTask()
    prompts = task.test_prompts(64) * 16
    _, kl = reward_and_kl(policy, ref, tok, task, prompts, generator=torch.Generator().manual_seed(1))
    roll = sample(policy, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_logps = sequence_logprobs(ref, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                      roll.prompt_mask).sum(-1)
    k1 = roll.logprobs.sum(-1) - ref_logps
    stderr = float(k1.std()) / len(prompts) ** 0.5
    assert kl > 0.05
    assert abs(kl - float(k1.mean())) < 4 * stderr + 1e-3


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "orpo", "kto", ["sigmoid", "sft"]])
def test_junk_on_padding_changes_nothing(checkpoint, monkeypatch, loss_type):
    """Token log-probs off the completion mask may hold anything (NaN, inf): train_dpo and batch_loss select them
    away, so a forward whose padding holds junk trains exactly as one whose padding holds 0."""
    import rlcourse.trainers.dpo as dpo_module
    from rlcourse.trainers.dpo import batch_loss

    model, tok = checkpoint
    pairs = PreferenceTask().preference_pairs(12, rng=5)
    args = DPOConfig(loss_type=loss_type, per_device_train_batch_size=4, max_steps=3)
    clean = train_dpo(copy.deepcopy(model), tok, pairs, args, progress=False)
    real = dpo_module.pair_token_logprobs

    def junk_on_padding(m, batch):
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0]).repeat(batch["completion_mask"].numel())
        pads = ~batch["completion_mask"].bool()
        return tuple(torch.where(p, junk[:p.numel()].view(p.shape), t) for t, p in zip(real(m, batch), pads.chunk(2)))
    monkeypatch.setattr(dpo_module, "pair_token_logprobs", junk_on_padding)
    junk = train_dpo(copy.deepcopy(model), tok, pairs, args, progress=False)
    for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert junk[key] == pytest.approx(clean[key], rel=1e-6), key
    # batch_loss on its own: per-token log-probs with NaN on padding give the loss of zeros there
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    tokens = -torch.rand(4, 3, dtype=torch.float64)
    junked = torch.where(mask.bool(), tokens, float("nan"))
    zeros = torch.where(mask.bool(), tokens, 0.0)
    ref = -torch.rand(2, dtype=torch.float64)
    a = batch_loss(args, *junked.chunk(2), mask, ref, ref - 0.5)
    b = batch_loss(args, *zeros.chunk(2), mask, ref, ref - 0.5)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
