"""A character-level tokenizer: one token per character, plus ``<pad>``, ``<bos>`` and ``<eos>``.

The synthetic tasks of the course ("12+34=46", "S=07:1303") are short strings over a small
alphabet, so a character vocabulary keeps the model tiny and every token readable. It is built
with the ``tokenizers`` library and wrapped as a ``transformers.PreTrainedTokenizerFast``, so it
behaves like any Hugging Face tokenizer (``save_pretrained``, ``from_pretrained``, batching,
padding) and the trainers in :mod:`rlcourse.lm` work unchanged with a real model's tokenizer.

Conventions that RL code relies on:

* every encoded text starts with ``<bos>``, so a left-padded prompt's first real token sits at
  position 0 once position ids are computed from the attention mask;
* ``<eos>`` is distinct from ``<pad>``: a completion ends at its first ``<eos>``, and pads after
  it must not be mistaken for the end of the text (nor the end for padding);
* ``padding_side="left"``: prompts of different lengths end at the same column, so the model's
  next token for every row is predicted from the last column.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits first (the arithmetic tasks), then the punctuation the task formats use, then letters.
DEFAULT_ALPHABET = "0123456789+-*=:;,.?!>|() abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Ids 0-3 are ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; character ``alphabet[i]`` has id ``4 + i``.
    Encoding prepends ``<bos>`` (pass ``add_special_tokens=False`` to encode a completion);
    decoding concatenates characters without spaces.
    """
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    if len(set(alphabet)) != len(alphabet):
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"alphabet must not repeat characters, but repeats {repeated}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split the text into single characters (a space is a character like any other).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # WordLevel would join tokens with spaces when decoding; Fuse glues them back together.
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])

    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=512)


def check_encodable(tokenizer, texts: list[str], name: str = "texts") -> None:
    """Raise a ``ValueError`` naming the first text that holds a character outside the vocabulary."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if unk in ids:
            bad = sorted({ch for ch in text if tokenizer.convert_tokens_to_ids(ch) == unk})
            raise ValueError(f"{name} contain characters outside the tokenizer's alphabet: "
                             f"{bad} in {text!r}")
