"""The character tokenizer: ids, special tokens, left padding, decoding and the save/load round trip."""
import rlcourse  # noqa: F401  (before torch)
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlcourse.lm.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, check_encodable


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_one_token_per_character_after_bos(tok):
    ids = tok("12+34=")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert ids[1:] == [4 + DEFAULT_ALPHABET.index(c) for c in "12+34="]
    assert tok("a b", add_special_tokens=False)["input_ids"] == [
        4 + DEFAULT_ALPHABET.index(c) for c in "a b"]


def test_special_tokens_are_distinct(tok):
    special = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert len(special) == 4
    assert tok.eos_token_id != tok.pad_token_id
    assert len(tok) == 4 + len(DEFAULT_ALPHABET)


def test_left_padding_and_mask(tok):
    enc = tok(["12+34=", "7+1="], padding=True)
    assert tok.padding_side == "left"
    assert enc["input_ids"][1][:2] == [tok.pad_token_id] * 2
    assert enc["attention_mask"] == [[1] * 7, [0, 0, 1, 1, 1, 1, 1]]


def test_decode_joins_characters_and_drops_specials(tok):
    text = "S=07: 1303 ab"
    ids = tok(text)["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("loader", [PreTrainedTokenizerFast.from_pretrained, AutoTokenizer.from_pretrained])
def test_save_load_round_trip(tok, tmp_path, loader):
    tok.save_pretrained(tmp_path)
    again = loader(tmp_path)
    texts = ["12+34=46", "S=07:", "ce:abba", "9"]
    assert again(texts, padding=True)["input_ids"] == tok(texts, padding=True)["input_ids"]
    assert again.padding_side == "left"
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert again.decode(again("12+34=46")["input_ids"], skip_special_tokens=True) == "12+34=46"


def test_unknown_characters_are_reported(tok):
    check_encodable(tok, ["12+34="])
    with pytest.raises(ValueError, match="outside the tokenizer's alphabet.*'#'"):
        check_encodable(tok, ["12#4="], "prompts")


@pytest.mark.parametrize("bad", ["", "aa", 5])
def test_bad_alphabet(bad):
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer(bad)
