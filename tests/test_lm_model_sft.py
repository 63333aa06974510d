"""Model factory and SFT: sizes, deterministic forward, the SFT loss against transformers' own."""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.lm.logprobs import position_ids_from_mask
from rlcourse.lm.model import SIZES, count_parameters, make_model
from rlcourse.trainers.sft import encode_examples, exact_match, lr_at, sft_loss, train_sft
from rlcourse.tasks.arithmetic import AdditionTask
from rlcourse.lm.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("size, low, high", [("tiny", 80e3, 150e3), ("small", 0.6e6, 1.5e6),
                                             ("demo", 7e6, 13e6)])
def test_sizes_have_the_advertised_parameter_counts(tok, size, low, high):
    assert low <= count_parameters(make_model(size, tok)) <= high


def test_dropout_is_off_so_train_mode_forward_is_deterministic(tok):
    model = make_model("tiny", tok, seed=0).train()
    ids = torch.randint(4, len(tok), (4, 9))
    assert torch.equal(model(ids).logits, model(ids).logits)
    noisy = make_model("tiny", tok, dropout=0.1, seed=0).train()
    assert not torch.equal(noisy(ids).logits, noisy(ids).logits)


def test_model_reads_the_tokenizer(tok):
    model = make_model("tiny", tok)
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    with pytest.raises(ValueError, match="size must be one of"):
        make_model("huge", tok)
    with pytest.raises(ValueError, match="dropout"):
        make_model("tiny", tok, dropout=1.5)
    assert set(SIZES) == {"tiny", "small", "demo"}


def test_encode_examples_masks_the_completion_and_eos_only(tok):
    ids, attn, loss_mask = encode_examples(tok, [{"prompt": "1+2=", "completion": "3"},
                                                 {"prompt": "12+34=", "completion": "46"}])
    assert ids.shape == (2, 10)
    # Row 0: 3 pads, <bos> 1 + 2 =, then "3" <eos>.
    assert attn[0].tolist() == [0, 0, 0] + [1] * 7
    assert loss_mask[0].tolist() == [0] * 8 + [1, 1]
    assert ids[0, -1] == tok.eos_token_id and ids[1, -1] == tok.eos_token_id
    assert loss_mask[1].tolist() == [0] * 7 + [1, 1, 1]
    with pytest.raises(ValueError, match="examples must be"):
        encode_examples(tok, [{"prompt": "1+2="}])


def test_sft_loss_equals_transformers_labels_loss(tok):
    """Oracle: the model's own cross-entropy with -100 labels on the prompt and pads."""
    model = make_model("tiny", tok, seed=1)
    rows = AdditionTask().sft_dataset(16, rng=0)
    ids, attn, loss_mask = encode_examples(tok, rows)
    labels = ids.masked_fill(loss_mask == 0, -100)
    hf = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
               labels=labels).loss
    assert torch.allclose(sft_loss(model, ids, attn, loss_mask), hf, atol=1e-6)


def test_lr_schedule():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_train_sft_learns_one_digit_addition(tok):
    torch.set_num_threads(1)
    task = AdditionTask(n_digits=1, test_fraction=0.2)
    model = make_model("tiny", tok, seed=0, n_layer=1)
    before = exact_match(model, tok, task, task.test_prompts(40))
    history = train_sft(model, tok, task.sft_dataset(2000, rng=0), steps=250, lr=1e-2, batch_size=64,
                        task=task, eval_prompts=task.test_prompts(40), eval_every=50, progress=False)
    assert set(history) >= {"step", "loss", "eval_step", "eval_exact_match", "seconds"}
    assert history["eval_step"] == [50, 100, 150, 200, 250]
    assert sum(history["loss"][-20:]) / 20 < 0.5 * sum(history["loss"][:20]) / 20
    assert before == 0.0 and history["eval_exact_match"][-1] > 0.5


def test_train_sft_stops_at_the_requested_accuracy(tok):
    task = AdditionTask(n_digits=1, test_fraction=0.2)
    model = make_model("tiny", tok, seed=0, n_layer=1)
    history = train_sft(model, tok, task.sft_dataset(2000, rng=0), steps=400, lr=1e-2, batch_size=64,
                        task=task, eval_prompts=task.prompts(40, rng=1), eval_every=10, stop_at=0.3,
                        progress=False)
    assert len(history["step"]) < 400
    assert history["eval_exact_match"][-1] >= 0.3 > max(history["eval_exact_match"][:-1], default=0)


def test_train_sft_bad_arguments(tok):
    model = make_model("tiny", tok)
    rows = [{"prompt": "1+1=", "completion": "2"}]
    with pytest.raises(ValueError, match="steps"):
        train_sft(model, tok, rows, steps=0)
    with pytest.raises(ValueError, match="lr"):
        train_sft(model, tok, rows, steps=1, lr=0)
    with pytest.raises(ValueError, match="stop_at needs"):
        train_sft(model, tok, rows, steps=1, stop_at=0.5)
    with pytest.raises(ValueError, match="outside the tokenizer's alphabet"):
        train_sft(model, tok, [{"prompt": "1#1=", "completion": "2"}], steps=1)
