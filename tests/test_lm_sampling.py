"""The sampler against independent oracles: a fresh full forward pass, HF generate, and the masks."""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch
import torch.nn.functional as F

from rlcourse.lm.logprobs import (next_token_logprobs, sequence_logprobs,
                                  token_logprobs_from_logits)
from rlcourse.lm.model import make_model
from rlcourse.lm.sampling import sample
from rlcourse.lm.tokenizer import build_char_tokenizer

# Variable lengths, so left padding and position ids are exercised.
PROMPTS = ["12+34=", "7+1=", "123456+7=", "S=07:", "ce:", "9"]
# <pad>, <bos>, <unk> of the character tokenizer: the sampler never draws them, and HF generate's
# greedy oracle is told the same (suppress_tokens).
SPECIAL = [0, 1, 3]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.set_num_threads(1)
    return make_model("tiny", tok, seed=0)


# The lean GPT-2 decoder, its fixed-shape (CUDA-graph) step run eagerly, and the model's own forward.
ENGINES = ["lean", "static", "hf"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, None), (1.5, 5), (0.0, None)])
def test_sampler_logprobs_equal_a_fresh_full_forward(model, tok, temperature, top_k, engine):
    g = torch.Generator().manual_seed(1)
    roll = sample(model, tok, PROMPTS, 12, temperature=temperature, top_k=top_k, generator=g,
                  engine=engine)
    # The oracle: one forward pass over [prompt | completion], no cache, recomputed log-probs.
    recomputed = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                   roll.prompt_mask, temperature=temperature or 1.0)
    assert torch.allclose(roll.logprobs, recomputed, atol=1e-5, rtol=0)
    assert (roll.logprobs[roll.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("engine", ENGINES)
def test_left_padding_does_not_change_logprobs(model, tok, engine):
    """A prompt alone and the same prompt padded in a batch get the same completion log-probs."""
    g = torch.Generator().manual_seed(2)
    roll = sample(model, tok, PROMPTS, 8, generator=g, engine=engine)
    for i, prompt in enumerate(PROMPTS):
        alone_ids = tok([prompt], return_tensors="pt")["input_ids"]
        alone = sequence_logprobs(model, alone_ids, roll.completion_ids[i:i + 1],
                                  roll.completion_mask[i:i + 1])
        assert torch.allclose(alone, roll.logprobs[i:i + 1], atol=1e-5, rtol=0), prompt


def test_position_ids_matter(model, tok):
    """Without position ids from the mask, padded rows get different (wrong) log-probs."""
    roll = sample(model, tok, PROMPTS, 6, generator=torch.Generator().manual_seed(3))
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    mask = torch.cat([roll.prompt_mask, roll.completion_mask], 1)
    naive = model(input_ids=ids, attention_mask=mask).logits  # positions 0..L-1, pads included
    P = roll.prompt_ids.shape[1]
    naive_lp = token_logprobs_from_logits(naive[:, P - 1:-1], roll.completion_ids) * roll.completion_mask
    padded = roll.prompt_mask[:, 0] == 0
    assert (naive_lp[padded] - roll.logprobs[padded]).abs().max() > 1e-3
    assert torch.allclose(naive_lp[~padded], roll.logprobs[~padded], atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_nothing_after_eos_is_counted(model, tok, engine):
    # An untrained model at a high temperature draws <eos> with probability ~1/81 per step:
    # over 20 steps some rows end early and others run to the limit.
    roll = sample(model, tok, PROMPTS * 16, 20, temperature=2.0,
                  generator=torch.Generator().manual_seed(4), engine=engine)
    eos = roll.completion_ids == tok.eos_token_id
    ended = eos.any(1)
    assert ended.sum() >= 5 and (~ended).sum() >= 5          # both kinds of rows are present
    T = roll.completion_ids.shape[1]
    for i in range(len(roll.completions)):
        stop = int(eos[i].float().argmax()) + 1 if ended[i] else T   # tokens that count
        assert roll.completion_mask[i, :stop].eq(1).all()            # up to and including <eos>
        assert roll.completion_mask[i, stop:].eq(0).all()            # nothing after it
        assert (roll.completion_ids[i, stop:] == tok.pad_token_id).all()
        assert (roll.logprobs[i, stop:] == 0).all()
        text_end = stop - 1 if ended[i] else stop                    # the closing <eos> is not text;
        assert roll.completions[i] == tok.decode(roll.completion_ids[i, :text_end].tolist(),  # any other
                                                 skip_special_tokens=False)                   # token is
    assert torch.equal(roll.finished, ended)


@pytest.mark.parametrize("engine", ENGINES)
def test_seeded_sampler_is_deterministic(model, tok, engine):
    a = sample(model, tok, PROMPTS, 10, generator=torch.Generator().manual_seed(7), engine=engine)
    b = sample(model, tok, PROMPTS, 10, generator=torch.Generator().manual_seed(7), engine=engine)
    c = sample(model, tok, PROMPTS, 10, generator=torch.Generator().manual_seed(8), engine=engine)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_matches_hf_generate(model, tok, engine):
    roll = sample(model, tok, PROMPTS, 10, temperature=0.0, engine=engine)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, suppress_tokens=SPECIAL)
    hf = out[:, enc["input_ids"].shape[1]:]
    T = roll.completion_ids.shape[1]
    ours = roll.completion_ids.masked_fill(roll.completion_mask == 0, tok.pad_token_id)
    assert torch.equal(ours, hf[:, :T])


def test_top_k_only_draws_from_the_k_best(model, tok):
    roll = sample(model, tok, PROMPTS * 20, 1, temperature=1.0, top_k=3,
                  generator=torch.Generator().manual_seed(5))
    full = next_token_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.prompt_mask)[:, 0]
    rank = (full > full.gather(1, roll.completion_ids)).sum(1)  # how many tokens beat the drawn one
    assert (rank < 3).all()


def test_first_token_frequencies_match_the_softmax(model, tok):
    """Sampling at T draws from softmax(logits / T) with <pad>, <bos>, <unk> removed and the rest
    renormalised: a chi-square-style check on 4000 draws."""
    n = 4000
    roll = sample(model, tok, ["12+34="] * n, 1, temperature=0.5,
                  generator=torch.Generator().manual_seed(6))
    probs = next_token_logprobs(model, roll.prompt_ids[:1], roll.completion_ids[:1],
                                roll.prompt_mask[:1], temperature=0.5)[0, 0].exp()
    probs[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = 0.0
    probs = probs / probs.sum()
    counts = torch.bincount(roll.completion_ids[:, 0], minlength=probs.numel()).float()
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 5 * sd + 1).all()


def test_token_logprobs_is_a_gather_not_a_vocabulary_sum():
    logits = torch.randn(3, 4, 7)
    tokens = torch.randint(0, 7, (3, 4))
    expected = torch.distributions.Categorical(logits=logits / 0.8).log_prob(tokens)
    assert torch.allclose(token_logprobs_from_logits(logits, tokens, 0.8), expected, atol=1e-6)
    wrong = F.log_softmax(logits, -1).sum(-1)                 # the vocabulary-sum slip
    assert not torch.allclose(token_logprobs_from_logits(logits, tokens), wrong)


def test_next_token_logprobs_are_distributions(model, tok):
    roll = sample(model, tok, PROMPTS, 5, generator=torch.Generator().manual_seed(9))
    full = next_token_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.prompt_mask)
    assert full.shape == (len(PROMPTS), roll.completion_ids.shape[1], len(tok))
    assert torch.allclose(full.exp().sum(-1), torch.ones(full.shape[:2]), atol=1e-5)
    picked = full.gather(-1, roll.completion_ids[..., None])[..., 0] * roll.completion_mask
    assert torch.allclose(picked, roll.logprobs, atol=1e-5)


def test_sequence_logprobs_has_gradients(model, tok):
    roll = sample(model, tok, PROMPTS, 5, generator=torch.Generator().manual_seed(10))
    # Decoding runs under inference_mode; what it returns must be ordinary tensors that a backward
    # pass may save (a product saves both factors) and that may be changed in place.
    fields = (roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask, roll.logprobs)
    assert not any(t.is_inference() for t in fields)
    lp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    (lp * roll.logprobs.exp()).sum().backward()
    roll.logprobs.mul_(1.0)
    assert model.transformer.wte.weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts="12+34=", max_new_tokens=3), "prompts must be a non-empty list"),
    (dict(prompts=[], max_new_tokens=3), "prompts must be a non-empty list"),
    (dict(prompts=["1+1="], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=["1+1="], max_new_tokens=3, temperature=-1), "temperature"),
    (dict(prompts=["1+1="], max_new_tokens=3, top_k=0), "top_k"),
    (dict(prompts=["1#1="], max_new_tokens=3), "outside the tokenizer's alphabet"),
    (dict(prompts=["1+1="], max_new_tokens=100), "exceeds the model's 64 positions"),
])
def test_bad_arguments_are_named(model, tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample(model, tok, **kwargs)


def test_logprob_shape_errors(model, tok):
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="completion_mask must have"):
        sequence_logprobs(model, ids, ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="same batch size"):
        sequence_logprobs(model, ids, ids[:1], torch.ones(1, 3))
    with pytest.raises(ValueError, match="tokens must have shape"):
        token_logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("engine", ["auto", "static"])
def test_every_engine_draws_the_same_tokens(model, tok, engine):
    """Same seed, same distribution: the lean decoders and the HF forward pick identical tokens."""
    a = sample(model, tok, PROMPTS * 4, 15, generator=torch.Generator().manual_seed(11), engine=engine)
    b = sample(model, tok, PROMPTS * 4, 15, generator=torch.Generator().manual_seed(11), engine="hf")
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_lean_decoder_is_used_only_where_exact(model, tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlcourse.lm import fast_gpt2
    model.eval()
    assert fast_gpt2.supports(model)
    odd = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_layer=1, n_embd=32, n_head=2,
                                     scale_attn_by_inverse_layer_idx=True)).eval()
    assert not fast_gpt2.supports(odd)
    # ...and the sampler still works on it, through the model's own forward.
    roll = sample(odd, tok, PROMPTS, 4, generator=torch.Generator().manual_seed(0))
    fresh = sequence_logprobs(odd, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    assert torch.allclose(roll.logprobs, fresh, atol=1e-5)


def test_any_causal_lm_works_through_its_own_forward(tok):
    """A tiny Llama (rotary positions, no GPT-2 internals): the generic path, same guarantees."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    roll = sample(llama, tok, PROMPTS, 10, temperature=1.3, generator=torch.Generator().manual_seed(0))
    fresh = sequence_logprobs(llama, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                              roll.prompt_mask, temperature=1.3)
    assert torch.allclose(roll.logprobs, fresh, atol=1e-5, rtol=0)
    greedy = sample(llama, tok, PROMPTS, 10, temperature=0.0)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    hf = llama.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, suppress_tokens=SPECIAL)[:, enc["input_ids"].shape[1]:]
    ours = greedy.completion_ids.masked_fill(greedy.completion_mask == 0, tok.pad_token_id)
    assert torch.equal(ours, hf[:, :ours.shape[1]])
    with pytest.raises(ValueError, match="engine='static' decodes plain GPT-2 models only"):
        sample(llama, tok, PROMPTS, 4, engine="static")
    with pytest.raises(ValueError, match="engine must be one of"):
        sample(llama, tok, PROMPTS, 4, engine="graph")


def test_static_decoder_refills_its_buffers_for_a_new_batch(tok):
    """The kept-graph path: one StaticGPT2Decoder restarted on other prompts of the same shape."""
    from rlcourse.lm import fast_gpt2
    from rlcourse.lm.logprobs import position_ids_from_mask
    from rlcourse.lm.sampling import encode_prompts

    model = make_model("tiny", tok, seed=3).eval()
    first, second = ["12+34=", "7+1=", "9"], ["ce:", "88+10=", "S=07:"]
    shape = encode_prompts(tok, first)[1].shape
    decoder = fast_gpt2.StaticGPT2Decoder(model, encode_prompts(tok, first)[1], 5)
    for batch in (first, second):
        ids, mask = encode_prompts(tok, batch)
        assert ids.shape == shape
        decoder.restart(mask, None)
        fresh = fast_gpt2.GPT2Decoder(model, mask, 5)
        got = [decoder.prefill(ids, position_ids_from_mask(mask))]
        want = [fresh.prefill(ids, position_ids_from_mask(mask))]
        for token in ([5, 6, 7], [8, 9, 10], [11, 12, 13]):
            token = torch.tensor(token)
            got.append(decoder.step(token).clone())
            want.append(fresh.step(token))
        assert torch.allclose(torch.stack(got), torch.stack(want), atol=1e-5, rtol=0), batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_sampler_matches_a_fresh_forward_and_sees_weight_updates(tok):
    """On a GPU: graph replays give the log-probs of a full forward, kept graphs are reused across
    calls, and an in-place weight update (what an optimiser does) reaches a kept graph."""
    from rlcourse.lm import fast_gpt2

    model = make_model("tiny", tok, seed=0).cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    for round in range(3):
        roll = sample(model, tok, PROMPTS * 4, 12, generator=g)          # "auto" = static on CUDA
        fresh = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                  roll.prompt_mask)
        assert torch.allclose(roll.logprobs, fresh, atol=1e-5, rtol=0), round
        lean = sample(model, tok, PROMPTS * 4, 12, generator=torch.Generator(device="cuda").manual_seed(round),
                      engine="lean")
        graphed = sample(model, tok, PROMPTS * 4, 12, generator=torch.Generator(device="cuda").manual_seed(round))
        assert torch.equal(lean.completion_ids, graphed.completion_ids), round
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    assert len(fast_gpt2._GRAPHED[model]) == 1 and next(iter(fast_gpt2._GRAPHED[model].values())).graph is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_kept_cuda_graphs_do_not_keep_their_model_alive(tok):
    import gc

    from rlcourse.lm import fast_gpt2

    model = make_model("tiny", tok, seed=0).cuda().eval()
    sample(model, tok, PROMPTS, 6, generator=torch.Generator(device="cuda").manual_seed(0))
    assert model in fast_gpt2._GRAPHED
    before = len(fast_gpt2._GRAPHED)
    del model
    gc.collect()
    assert len(fast_gpt2._GRAPHED) == before - 1


def test_small_batches_decode_on_one_thread_with_the_same_numbers(model, tok, monkeypatch):
    """decode_threads: one thread for a small step on a CPU, the same draws as two; torch's count restored."""
    from rlcourse.lm import sampling
    from rlcourse.runtime import intra_op_threads

    def fail_mid_decoding(self, token):
        raise RuntimeError("cache holds")

    with intra_op_threads(2):
        assert sampling.decode_threads(model, 64) == 1      # 64 rows x width 64: one thread
        assert sampling.decode_threads(model, 256) == 2     # a bigger step keeps torch's count
        prompts = PROMPTS * 11                               # 66 rows, each thread count forced below
        rolls = [sample(model, tok, prompts, 6, generator=torch.Generator().manual_seed(5), cpu_threads=n)
                 for n in (1, 2)]
        assert torch.get_num_threads() == 2
        assert torch.equal(rolls[0].completion_ids, rolls[1].completion_ids)
        assert torch.allclose(rolls[0].logprobs, rolls[1].logprobs, atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="cpu_threads"):
            sample(model, tok, PROMPTS, 3, cpu_threads=0)
        monkeypatch.setattr(sampling.GPT2Decoder, "step", fail_mid_decoding)
        with pytest.raises(RuntimeError, match="cache holds"):     # an error inside the decoding loop
            sample(model, tok, PROMPTS, 3, engine="lean", cpu_threads=1)
        assert torch.get_num_threads() == 2                 # restored after the error too


def _model_that_prefers_special_tokens(model, tok, scale=200.0):
    """A copy whose logits are the same at every position, ``W @ b`` with ``b`` along the rows of
    ``<pad>``, ``<bos>`` and ``<unk>``: ~85% of the mass sits on those three ids (still plain GPT-2,
    so every engine decodes it)."""
    import copy

    biased = copy.deepcopy(model)
    with torch.no_grad():
        W = biased.lm_head.weight
        ln = biased.transformer.ln_f
        ln.weight.zero_()
        ln.bias.copy_(scale * W[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]].sum(0))
    return biased


def _constant_logits(biased):
    with torch.no_grad():
        return biased.lm_head.weight @ biased.transformer.ln_f.bias


def test_banned_ids_are_pad_bos_unk_and_never_eos(tok):
    from types import SimpleNamespace

    from rlcourse.lm.sampling import banned_token_ids

    assert banned_token_ids(tok) == sorted([tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]) == SPECIAL
    assert tok.eos_token_id not in banned_token_ids(tok)
    # GPT-2's usual setting: <pad> is <eos>, and <eos> must stay drawable.
    gpt2_like = SimpleNamespace(eos_token_id=50256, pad_token_id=50256, bos_token_id=50256, unk_token_id=50256)
    assert banned_token_ids(gpt2_like) == []


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 4), (0.0, None)])
def test_sampled_completions_never_hold_pad_bos_or_unk(model, tok, engine, temperature, top_k):
    """The policy puts ~85% of its mass on <pad>/<bos>/<unk>; not one of them is drawn, and the
    log-prob stored for each drawn token is still the unmasked one that a trainer recomputes."""
    biased = _model_that_prefers_special_tokens(model, tok)
    banned = [tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]
    first = torch.softmax(_constant_logits(biased), dim=-1)
    assert float(first[banned].sum()) > 0.5  # without the mask most draws would be special tokens
    roll = sample(biased, tok, PROMPTS * 8, 10, temperature=temperature, top_k=top_k,
                  generator=torch.Generator().manual_seed(0), engine=engine)
    real = roll.completion_ids[roll.completion_mask.bool()]
    assert not torch.isin(real, torch.tensor(banned)).any()
    recomputed = sequence_logprobs(biased, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                   roll.prompt_mask, temperature=temperature or 1.0)
    torch.testing.assert_close(roll.logprobs, recomputed, atol=1e-5, rtol=1e-5)


def test_the_masked_draw_follows_the_renormalised_distribution(model, tok):
    """Oracle: with logits the same at every position, a draw is from
    ``softmax(logits / T)`` restricted to the allowed ids and renormalised."""
    biased = _model_that_prefers_special_tokens(model, tok)
    n, T = 20000, 1.3
    roll = sample(biased, tok, ["12+34="] * n, 1, temperature=T, generator=torch.Generator().manual_seed(5))
    logits = _constant_logits(biased)
    allowed = torch.ones_like(logits, dtype=torch.bool)
    allowed[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = False
    expected = torch.zeros_like(logits)
    expected[allowed] = torch.softmax(logits[allowed] / T, dim=-1)
    counts = torch.bincount(roll.completion_ids[:, 0], minlength=logits.numel()).double()
    se = (expected * (1 - expected) / n).sqrt().double()
    assert float(((counts / n - expected.double()).abs() - 5 * se).max()) < 1e-3
