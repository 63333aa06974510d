"""sequence_logprobs on awkward batches: padding anywhere, holes, odd pad ids, bad arguments.

The oracle is a loop over rows: each row's real tokens alone (no padding, no mask), one plain
forward pass, and the log-softmax read at each real completion token.
"""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcourse.lm.logprobs import next_token_logprobs, sequence_logprobs, token_logprobs_from_logits
from rlcourse.lm.model import make_model
from rlcourse.lm.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return make_model("tiny", build_char_tokenizer(), seed=0)


def per_row_oracle(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    out = torch.zeros(completion_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for b in range(prompt_ids.shape[0]):
            prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
            real = completion_mask[b].bool().nonzero().flatten().tolist()
            ids = torch.tensor([prompt + [int(completion_ids[b, t]) for t in real]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double() / temperature, -1)
            for j, t in enumerate(real):
                out[b, t] = logp[len(prompt) - 1 + j, int(completion_ids[b, t])]
    return out


def random_batch(seed, B=4, P=6, T=7, vocab=81, pad_ids=(0,)):
    """Left-padded prompts (each >= 1 token), completions with holes and a pad tail, odd pad ids."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    completion_mask = (torch.rand(B, T, generator=g) < 0.75).long()
    completion_mask[0] = 1                                      # one full row
    completion_mask[B - 1, T // 2:] = 0                         # one row ending early (EOS then pads)
    prompt_ids = torch.randint(0, vocab, (B, P), generator=g)
    completion_ids = torch.randint(0, vocab, (B, T), generator=g)
    pads = torch.tensor(pad_ids)[torch.randint(0, len(pad_ids), (B, P + T), generator=g)]
    prompt_ids = torch.where(prompt_mask.bool(), prompt_ids, pads[:, :P])
    completion_ids = torch.where(completion_mask.bool(), completion_ids, pads[:, P:])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.7, 1.6]),
       shape=st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 7)))
def test_matches_each_row_alone_whatever_the_padding(model, seed, temperature, shape):
    B, P, T = shape
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(
        seed, B, P, T, pad_ids=(0, 5, -100, 10_000))
    got = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature)
    want = per_row_oracle(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    assert (got[completion_mask == 0] == 0).all()                # exactly 0, not -0.0 * something


def test_pad_ids_cannot_change_a_real_log_prob_by_a_single_bit(model):
    batches = [random_batch(7, pad_ids=pads) for pads in ((0,), (80,), (-100, 3, 10_000))]
    outs = [sequence_logprobs(model, p, c, cm, pm) for p, pm, c, cm in batches]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_gradient_is_finite_and_pads_get_none(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(3, pad_ids=(-100,))
    logp = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask)
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()


def test_right_padded_prompts_are_refused(model):
    # Before: accepted, and the first completion token was read from a pad's column (4.1 nats off).
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(1)
    prompt_mask[2] = torch.tensor([1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="prompt_mask must be 1 in the last column.*row 2.*padding_side='left'"):
        sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask)
    with pytest.raises(ValueError, match="prompt_ids has no columns"):
        sequence_logprobs(model, prompt_ids[:, :0], completion_ids, completion_mask, prompt_mask[:, :0])


def test_more_real_tokens_than_positions_is_refused_but_long_padding_is_fine(model):
    n = model.config.max_position_embeddings
    ids = torch.randint(0, 81, (1, n + 1))
    with pytest.raises(ValueError, match=f"{n + 1} real tokens.*{n} positions"):
        sequence_logprobs(model, ids[:, :10], ids[:, 10:], torch.ones(1, n - 9))    # before: IndexError
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(2, B=2, P=4, T=5)
    pad = torch.zeros(2, n, dtype=torch.long)                  # n more columns, all padding
    long_ids, long_mask = torch.cat([pad, prompt_ids], 1), torch.cat([pad, prompt_mask], 1)
    torch.testing.assert_close(sequence_logprobs(model, long_ids, completion_ids, completion_mask, long_mask),
                               sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask),
                               atol=2e-5, rtol=0)


def test_token_ids_outside_the_vocabulary_are_refused(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(4)
    bad = completion_ids.clone()
    bad[0, 0] = 81
    with pytest.raises(ValueError, match=r"completion_ids must hold token ids in \[0, 81\)"):
        sequence_logprobs(model, prompt_ids, bad, completion_mask, prompt_mask)   # before: IndexError
    bad = prompt_ids.clone()
    bad[0, -1] = -1
    with pytest.raises(ValueError, match="prompt_ids must hold token ids"):
        sequence_logprobs(model, bad, completion_ids, completion_mask, prompt_mask)
    with pytest.raises(ValueError, match="completion_ids must be an integer tensor"):
        sequence_logprobs(model, prompt_ids, completion_ids.float(), completion_mask, prompt_mask)
    with pytest.raises(ValueError, match="tokens must hold token ids"):
        token_logprobs_from_logits(torch.zeros(1, 2, 5), torch.tensor([[0, 5]]))


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 0.0, -1.0, True, "1.0"])
def test_bad_temperatures_are_refused(model, temperature):
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(5)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature)
    with pytest.raises(ValueError, match="temperature"):
        next_token_logprobs(model, prompt_ids, completion_ids, prompt_mask, temperature)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_logits(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), temperature)


def test_masks_must_be_zero_or_one_and_of_the_right_shape(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(6)
    with pytest.raises(ValueError, match="completion_mask must hold only 0/1"):
        sequence_logprobs(model, prompt_ids, completion_ids, completion_mask * 2, prompt_mask)
    with pytest.raises(ValueError, match=r"prompt_mask must have shape \(4, 6\)"):
        sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask[:, 1:])
    with pytest.raises(ValueError, match="completion_mask is required"):
        sequence_logprobs(model, prompt_ids, completion_ids, None, prompt_mask)
    bool_mask = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask.bool(), prompt_mask.bool())
    assert torch.equal(bool_mask, sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask))


def test_an_empty_completion_has_log_prob_zero(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_batch(8)
    logp = sequence_logprobs(model, prompt_ids, completion_ids[:, :0], completion_mask[:, :0], prompt_mask)
    assert logp.shape == (4, 0) and torch.equal(logp.sum(-1), torch.zeros(4))
    assert next_token_logprobs(model, prompt_ids, completion_ids[:, :0], prompt_mask).shape == (4, 0, 81)
