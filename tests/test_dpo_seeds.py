"""Seed-batched DPO: each seed's loss, gradient and run are those of rlcourse.trainers.dpo run on that seed alone."""
import copy

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from rlcourse.lm import load_checkpoint
from rlcourse.trainers.dpo import DPOConfig, _reference_logps, batch_loss, pair_token_logprobs, select_pairs, train_dpo
from rlcourse.tasks.reward_model import encode_preference_pairs
from rlcourse.lm.seed_stack import stack_models
from rlcourse.trainers.dpo_seeds import seed_losses, train_dpo_seeds
from seed_helpers import perturbed_copies, relative_error


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _pairs(n, offset):
    out = []
    for i in range(n):
        a, b = (7 * i + offset) % 50, (3 * i + 2 * offset) % 40
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + i % 3)})
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", ["sigmoid", "sft"]], ids=str)
def test_given_the_same_pairs_each_seeds_loss_and_gradient_are_its_own(checkpoint, loss_type, dtype, tol):
    model, tok = checkpoint
    args = DPOConfig(beta=0.3, loss_type=loss_type, label_smoothing=0.1 if loss_type == "robust" else 0.0)
    models = perturbed_copies(model, [0, 1, 2], dtype, offset=50)
    pairs = [_pairs(9, 0), _pairs(5, 11), _pairs(12, 23)]
    data = [encode_preference_pairs(tok, p) for p in pairs]
    refs = perturbed_copies(model, [7, 8, 9], dtype, offset=50)                      # a reference of each seed's own
    tables = [_reference_logps(r, d, 64) for r, d in zip(refs, data)]
    picked = [torch.tensor([4, 0, 7, 2]), torch.tensor([3, 1]), torch.tensor([11, 5, 6, 0])]   # one batch is short
    stack = stack_models(models)
    losses = seed_losses(stack, args, data, picked, tables, torch.tensor([True, True, True]), tok.pad_token_id)
    sum(loss for loss, _, _ in losses.values()).backward()
    stacked = dict(stack.named_parameters())
    for s, m in enumerate(models):
        batch = select_pairs(data[s], picked[s])
        chosen_tok, rejected_tok = pair_token_logprobs(m, batch)
        ref = [t[picked[s]] for t in tables[s]]
        loss, _, _ = batch_loss(args, chosen_tok, rejected_tok, batch["completion_mask"], *ref)
        loss.backward()
        assert abs(float(losses[s][0].detach()) - float(loss.detach())) <= tol * max(1.0, abs(float(loss.detach())))
        for name, p in m.named_parameters():
            assert relative_error(stacked[name].grad[s], p.grad) < tol, (s, name)


def test_each_seed_trains_as_train_dpo_trains_it_alone(checkpoint):
    """Three seeds with different pairs (so different step counts and a short last batch), AdamW with weight
    decay and a linear schedule: the same minibatches, losses and learning rates as train_dpo seed by seed."""
    model, tok = checkpoint
    args = DPOConfig(beta=0.2, loss_type=["sigmoid", "sft"], learning_rate=5e-4, per_device_train_batch_size=4,
                     num_train_epochs=2, weight_decay=0.01, precompute_ref_log_probs=True)
    pairs = [_pairs(10, 0), _pairs(7, 5), _pairs(12, 9)]
    seeds = [3, 4, 5]
    together = [copy.deepcopy(model) for _ in seeds]
    histories = train_dpo_seeds(together, tok, pairs, args, seeds=seeds, progress=False)
    for s, seed in enumerate(seeds):
        alone = copy.deepcopy(model)
        single = train_dpo(alone, tok, pairs[s], _with_seed(args, seed), progress=False)
        mine = histories[s]
        assert mine["step"] == single["step"] and mine["learning_rate"] == pytest.approx(single["learning_rate"])
        assert mine["loss"][0] == pytest.approx(single["loss"][0], rel=1e-6)     # same weights, same minibatch
        assert mine["loss"] == pytest.approx(single["loss"], rel=2e-3)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        moved_alone = torch.cat([p.detach().flatten() for p in alone.parameters()]) - start
        moved_together = torch.cat([p.detach().flatten() for p in together[s].parameters()]) - start
        assert float(F.cosine_similarity(moved_alone, moved_together, dim=0)) > 0.999


def test_each_run_keeps_its_own_settings(checkpoint):
    """One config per model: different beta, loss type, label smoothing and learning rate in one stack, each run
    as train_dpo runs it alone with its own config."""
    model, tok = checkpoint
    common = dict(per_device_train_batch_size=4, max_steps=5, precompute_ref_log_probs=True)
    configs = [DPOConfig(beta=0.3, learning_rate=1e-3, **common),
               DPOConfig(beta=0.1, loss_type="robust", label_smoothing=0.2, learning_rate=1e-4, **common),
               DPOConfig(beta=1.0, loss_type=["sigmoid", "sft"], learning_rate=3e-3, lr_scheduler_type="constant",
                         **common)]
    pairs, seeds = _pairs(10, 0), [3, 3, 4]
    together = [copy.deepcopy(model) for _ in configs]
    histories = train_dpo_seeds(together, tok, pairs, configs, seeds=seeds, progress=False)
    for s, (config, seed) in enumerate(zip(configs, seeds)):
        single = train_dpo(copy.deepcopy(model), tok, pairs, _with_seed(config, seed), progress=False)
        assert histories[s]["learning_rate"] == pytest.approx(single["learning_rate"])
        assert histories[s]["loss"][0] == pytest.approx(single["loss"][0], rel=1e-6)
        assert histories[s]["loss"] == pytest.approx(single["loss"], rel=2e-3)
        assert histories[s]["rewards/margins"] == pytest.approx(single["rewards/margins"], rel=1e-2, abs=1e-4)
    with pytest.raises(ValueError, match="share per_device_train_batch_size"):
        train_dpo_seeds([model, model], tok, pairs, [DPOConfig(), DPOConfig(per_device_train_batch_size=2)],
                        progress=False)
    with pytest.raises(ValueError, match="one DPOConfig per model"):
        train_dpo_seeds([model, model], tok, pairs, [DPOConfig()], progress=False)


def _with_seed(args, seed):
    fields = {k: v for k, v in vars(args).items() if k != "loss_types"}
    return DPOConfig(**{**fields, "seed": seed})


def test_bad_input_is_named(checkpoint):
    model, tok = checkpoint
    with pytest.raises(ValueError, match="one per model"):
        train_dpo_seeds([model, model], tok, [_pairs(4, 0)] * 3, DPOConfig(), progress=False)
    with pytest.raises(ValueError, match="one seed per model"):
        train_dpo_seeds([model, model], tok, _pairs(4, 0), DPOConfig(), seeds=[1], progress=False)
