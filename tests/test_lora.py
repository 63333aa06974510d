"""LoRA (rlcourse.lm.lora): the adapted layer equals its merged matrix, B = 0 gives the base model exactly,
only A and B train, and merging gives back a plain GPT-2 with the adapted model's outputs."""
import copy

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
from transformers.pytorch_utils import Conv1D

from rlcourse.lm import load_checkpoint
from rlcourse.lm.fast_gpt2 import supports
from rlcourse.lm.lora import LoRALinear, apply_lora, lora_layers, merge_lora, trainable_parameters


@pytest.fixture(scope="module")
def base():
    model, tokenizer = load_checkpoint("addition", device="cpu")
    return model.eval(), tokenizer


def _ids(tokenizer, texts=("12+34=46", "7+8=15", "S=07:34")):
    enc = tokenizer(list(texts), padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("r, alpha", [(1, 32.0), (3, 4.0)])
def test_forward_equals_the_merged_matrix(kind, r, alpha):
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5) if kind == "linear" else Conv1D(5, 6)
    if kind == "conv1d":
        torch.nn.init.normal_(base.weight)
        torch.nn.init.normal_(base.bias)
    layer = LoRALinear(base, r=r, alpha=alpha, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 4, 6)
    w = base.weight if kind == "linear" else base.weight.T            # (out, in)
    merged = w + (alpha / r) * layer.lora_B @ layer.lora_A
    torch.testing.assert_close(layer(x), x @ merged.T + base.bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.merged_weight(), merged)
    torch.testing.assert_close(layer.merged()(x), layer(x), atol=1e-5, rtol=1e-5)


def test_zero_b_gives_the_base_model_exactly(base):
    model, tokenizer = base
    ids, attention = _ids(tokenizer)
    want = model(input_ids=ids, attention_mask=attention).logits
    for targets in ("all", "attention"):
        adapted = apply_lora(copy.deepcopy(model), r=1, targets=targets, seed=3)
        got = adapted(input_ids=ids, attention_mask=attention).logits
        assert torch.equal(got, want)     # exactly: B = 0 adds an exact zero


def test_only_a_and_b_train_and_counts(base):
    model, _ = base
    n_layer, d = model.config.n_layer, model.config.n_embd
    every = apply_lora(copy.deepcopy(model), r=1, targets="all")
    # per block: c_attn (d -> 3d), attn.c_proj (d -> d), c_fc (d -> 4d), mlp.c_proj (4d -> d); rank 1: in + out each
    assert trainable_parameters(every) == n_layer * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))
    attention = apply_lora(copy.deepcopy(model), r=2, targets="attention")
    assert trainable_parameters(attention) == n_layer * 2 * ((d + 3 * d) + (d + d))
    assert {n.rsplit(".", 1)[-1] for n, p in every.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    assert len(lora_layers(every)) == 4 * n_layer and len(lora_layers(attention)) == 2 * n_layer


def test_gradient_reaches_b_at_zero_and_merge_gives_plain_gpt2(base):
    model, tokenizer = base
    ids, attention = _ids(tokenizer)
    adapted = apply_lora(copy.deepcopy(model), r=1, targets="all", seed=0)
    assert not supports(adapted)
    adapted(input_ids=ids, attention_mask=attention).logits.logsumexp(-1).sum().backward()
    layer = next(iter(lora_layers(adapted).values()))
    assert layer.lora_B.grad.abs().sum() > 0 and layer.lora_A.grad.abs().sum() == 0   # B = 0 blocks A's gradient
    with torch.no_grad():
        for layer in lora_layers(adapted).values():
            layer.lora_B.normal_(std=0.1)
        want = adapted(input_ids=ids, attention_mask=attention).logits
        merged = merge_lora(adapted)
        assert supports(merged.eval()) and not lora_layers(merged)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=attention).logits, want, atol=1e-4, rtol=1e-4)


def test_bad_arguments(base):
    model, _ = base
    with pytest.raises(ValueError, match="targets"):
        apply_lora(copy.deepcopy(model), targets="mlp_only")
    with pytest.raises(ValueError, match="r must"):
        LoRALinear(torch.nn.Linear(3, 3), r=0)
    with pytest.raises(TypeError, match="base must"):
        LoRALinear(torch.nn.Conv2d(1, 1, 1))
    twice = apply_lora(copy.deepcopy(model))
    with pytest.raises(ValueError, match="already"):
        apply_lora(twice)
