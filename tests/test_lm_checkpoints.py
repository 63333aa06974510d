"""The shipped checkpoints: they load, they measure what their recipes say, the CLI reproduces them."""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.lm.checkpoints import (available_checkpoints, checkpoint_info, load_checkpoint,
                                     save_checkpoint)
from rlcourse.lm.sampling import sample
from rlcourse.trainers.sft import exact_match
from rlcourse.tasks import AdditionTask, DigitSumTask, PreferenceTask
from rlcourse.tools.train_checkpoints import RECIPES, train_recipe


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def test_every_recipe_is_shipped_with_its_record():
    assert set(available_checkpoints()) >= set(RECIPES)
    for name in RECIPES:
        info = checkpoint_info(name)
        assert info["recipe"] == RECIPES[name], f"{name}: recipe.json is stale, retrain it"
        assert info["command"] == f"python -m rlcourse.tools.train_checkpoints {name}"


def test_partial_checkpoint_is_partial():
    """The RL starting point: held-out greedy exact match in [20%, 60%], as its record says."""
    model, tok = load_checkpoint("addition-partial", device="cpu")
    task = AdditionTask()
    em = exact_match(model, tok, task, task.test_prompts(500))
    assert 0.20 <= em <= 0.60
    assert em == pytest.approx(checkpoint_info("addition-partial")["results"]["test_exact_match_greedy"], abs=0.03)


def test_addition_checkpoint_is_well_trained():
    model, tok = load_checkpoint("addition", device="cpu")
    task = AdditionTask()
    assert exact_match(model, tok, task, task.test_prompts(500)) >= 0.95


def test_digitsum_sft_does_not_beat_its_demonstrations():
    """Imitating demonstrations that are 50% wrong gives at most ~50% valid samples."""
    model, tok = load_checkpoint("digitsum-sft", device="cpu")
    task = DigitSumTask()
    prompts = task.test_prompts(370)
    sampled = exact_match(model, tok, task, prompts, greedy=False, generator=torch.Generator().manual_seed(0))
    assert 0.1 < sampled < 0.55
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(0))
    # It learned the format: four digits then <eos>.
    assert sum(len(c) == 4 and c.isdigit() for c in roll.completions) / len(prompts) > 0.9


def test_preference_base_policy_writes_like_the_reference():
    """preference-sft imitates random words: valid words, gold score like the reference data's."""
    model, tok = load_checkpoint("preference-sft", device="cpu")
    task = PreferenceTask()
    prompts = task.test_prompts(512)
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(0))
    gold = task.reward(prompts, roll.completions)
    reference = task.reward(prompts, [task.reference_completion(i) for i in range(len(prompts))])
    assert (gold > -1).float().mean() > 0.97                 # letters a-h, 1 to 7 of them
    assert abs(gold.mean() - reference.mean()) < 0.05        # no preference learned yet
    assert len({len(c) for c in roll.completions}) == task.max_length


def test_unknown_checkpoint_is_named():
    with pytest.raises(ValueError, match="no checkpoint named 'nope'.*addition"):
        load_checkpoint("nope")


def test_save_load_round_trip(tmp_path, monkeypatch):
    model, tok = load_checkpoint("addition", device="cpu")
    save_checkpoint(model, tok, tmp_path / "copy", {"note": "test"})
    monkeypatch.setattr("rlcourse.lm.checkpoints.CHECKPOINT_DIR", tmp_path)
    again, tok2 = load_checkpoint("copy", device="cpu")
    ids = tok(["12+34=", "5+5="], padding=True, return_tensors="pt")
    assert torch.equal(model(**ids).logits, again(**ids).logits)
    assert tok2.padding_side == "left" and checkpoint_info("copy") == {"note": "test"}


def test_train_cli_reproduces_the_partial_checkpoint(tmp_path):
    """Retrain addition-partial from its recipe (~15 s) and measure the same held-out accuracy."""
    record = train_recipe("addition-partial", tmp_path, progress=False)
    shipped = checkpoint_info("addition-partial")["results"]
    assert (tmp_path / "addition-partial" / "model.safetensors").is_file()
    assert 0.20 <= record["results"]["test_exact_match_greedy"] <= 0.60
    assert record["results"]["test_exact_match_greedy"] == pytest.approx(shipped["test_exact_match_greedy"], abs=0.05)
