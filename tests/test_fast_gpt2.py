"""The lean GPT-2 forward (rlcourse.lm.fast_gpt2) against the oracle: transformers' own forward pass.

The training forward computes each distinct prompt once and lets its completions share that copy;
the logits and every parameter's gradient must equal those of the plain forward over the repeated
batch. In float64, so that any difference left is a bug and not rounding.
"""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.lm import fast_gpt2
from rlcourse.lm.logprobs import completion_logits, position_ids_from_mask, sequence_logprobs
from rlcourse.lm.model import make_model
from rlcourse.lm.sampling import encode_prompts, sample
from rlcourse.lm.tokenizer import build_char_tokenizer

PROMPTS = ["12+34=", "7+1=", "123456+7=", "9"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture()
def model(tok):
    return make_model("tiny", tok, seed=3).double().train()


def _batch(tok, gen):
    """Repeated prompts in scrambled order, left padding, completions with trailing pads and a hole."""
    order = [0, 2, 0, 1, 3, 2, 0, 1, 3, 3]
    prompt_ids, prompt_mask = encode_prompts(tok, [PROMPTS[i] for i in order])
    n, width = len(order), 6
    completion_ids = torch.randint(4, len(tok), (n, width), generator=gen)
    lengths = torch.tensor([1, 6, 3, 4, 2, 6, 5, 1, 3, 4])
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_mask[5, 2] = 0                                        # a hole inside a completion
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 999)   # garbage where masked
    return prompt_ids, completion_ids, prompt_mask, completion_mask


def _transformers_window(model, prompt_ids, completion_ids, prompt_mask, completion_mask):
    mask = torch.cat([prompt_mask, completion_mask], 1)
    ids = torch.cat([prompt_ids, completion_ids], 1).masked_fill(mask == 0, 0)
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                 use_cache=False, logits_to_keep=completion_ids.shape[1] + 1).logits


def test_shared_prompt_forward_equals_transformers_logits_and_gradients(model, tok):
    gen = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids, prompt_mask, completion_mask = _batch(tok, gen)
    assert fast_gpt2.supports(model)
    u_ids, u_mask, inverse = fast_gpt2.distinct_prompts(prompt_ids, prompt_mask)
    assert len(u_ids) == len(PROMPTS) and torch.equal(u_ids[inverse] * u_mask[inverse], prompt_ids * prompt_mask)

    probe = torch.randn(completion_ids.shape[1] + 1, len(tok), generator=gen, dtype=torch.float64)
    real = torch.cat([prompt_mask[:, -1:], completion_mask], 1).bool()   # window columns that are real tokens

    def value_and_grads(window):
        value = (window * probe).sum(-1)[real].sum()
        return value, torch.autograd.grad(value, list(model.parameters()))

    clean_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    lean = fast_gpt2.completion_window_logits(model, prompt_ids, prompt_mask, clean_ids, completion_mask)
    oracle = _transformers_window(model, prompt_ids, clean_ids, prompt_mask, completion_mask)
    assert torch.allclose(lean[real], oracle[real], atol=1e-10, rtol=0)
    (v1, g1), (v2, g2) = value_and_grads(lean), value_and_grads(oracle)
    assert abs(float((v1 - v2).detach())) < 1e-9
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert max(float(g.abs().max()) for g in g1) > 1e-2               # a real gradient, not two zeros


def test_completion_logprobs_use_the_lean_path_and_agree_with_transformers(model, tok, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    batch = _batch(tok, gen)
    lean = sequence_logprobs(model, *batch[:2], batch[3], batch[2])
    monkeypatch.setattr(fast_gpt2, "supports", lambda m: False)
    oracle = sequence_logprobs(model, *batch[:2], batch[3], batch[2])
    assert torch.allclose(lean, oracle, atol=1e-10, rtol=0) and bool((lean != 0).any())
    # completion_logits too (what the trainers call), including the hole's read-from-last-real-column rule.
    monkeypatch.undo()
    assert torch.allclose(completion_logits(model, *batch[:2], batch[2], batch[3])[batch[3].bool()],
                          _oracle_completion_logits(model, batch, monkeypatch)[batch[3].bool()], atol=1e-10, rtol=0)


def _oracle_completion_logits(model, batch, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(fast_gpt2, "supports", lambda model: False)
        return completion_logits(model, *batch[:2], batch[2], batch[3])


def test_sampler_with_repeated_prompts_matches_a_transformers_recomputation(tok, monkeypatch):
    model = make_model("tiny", tok, seed=5).eval()
    prompts = [p for p in PROMPTS for _ in range(4)][::-1]
    roll = sample(model, tok, prompts, 10, generator=torch.Generator().manual_seed(2))
    assert torch.equal(roll.prompt_ids, encode_prompts(tok, prompts)[0])
    monkeypatch.setattr(fast_gpt2, "supports", lambda m: False)
    fresh = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    assert torch.allclose(roll.logprobs, fresh, atol=1e-5, rtol=0)
    hf = sample(model, tok, prompts, 10, generator=torch.Generator().manual_seed(2), engine="hf")
    assert torch.equal(roll.completion_ids, hf.completion_ids)


def test_supports_only_plain_gpt2_without_active_dropout(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = make_model("tiny", tok, seed=0)
    assert fast_gpt2.supports(plain.train()) and fast_gpt2.supports(plain.eval())
    dropout = make_model("tiny", tok, dropout=0.1, seed=0)
    assert fast_gpt2.supports(dropout.eval()) and not fast_gpt2.supports(dropout.train())
    plain.transformer.h[1].attn.attn_dropout.p = 0.1        # switched on by hand, not through the config
    assert fast_gpt2.supports(plain.eval()) and not fast_gpt2.supports(plain.train())

    class Adapter(torch.nn.Module):          # e.g. a LoRA layer patched over c_attn
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight, self.bias = inner, inner.weight, inner.bias

        def forward(self, x):
            return self.inner(x) + 1.0

    patched = make_model("tiny", tok, seed=0)
    patched.transformer.h[0].attn.c_attn = Adapter(patched.transformer.h[0].attn.c_attn)
    assert not fast_gpt2.supports(patched)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))
    assert not fast_gpt2.supports(llama)
