"""Length-normalised DPO (Tulu 3, Lambert et al. 2024, arXiv 2411.15124; TRL's ``loss_type="sigmoid_norm"``)
against a hand computation, finite differences and the identities that define it. Parity with TRL's own
``DPOTrainer`` code is in tests/test_trl_parity_dpo.py."""
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses import (DPO_LOSS_TYPES, dpo_sigmoid_loss, length_normalised_dpo_loss, preference_loss,
                             preference_objective)


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_one_pair_by_hand():
    # chosen: log pi = -6, log pi_ref = -8 over 4 tokens -> +0.5 per token
    # rejected: log pi = -3, log pi_ref = -2 over 2 tokens -> -0.5 per token
    # margin per token h = 0.5 - (-0.5) = 1; beta = 2: loss = -log sigmoid(2) = log(1 + e^-2)
    loss = length_normalised_dpo_loss(_t(-6.0), _t(-3.0), _t(-8.0), _t(-2.0), 2.0, _t(4.0), _t(2.0))
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-2.0)), rel=1e-12)
    # the same pair under plain DPO reads the whole log-ratios: h = 2 - (-1) = 3, loss = log(1 + e^-6)
    plain = dpo_sigmoid_loss(_t(-6.0), _t(-3.0), _t(-8.0), _t(-2.0), 2.0)
    assert float(plain) == pytest.approx(math.log(1 + math.exp(-6.0)), rel=1e-12)


def test_several_pairs_by_hand_and_the_gradient():
    cw, cl, rw, rl = _t(-5.0, -1.0, -9.0), _t(-4.0, -7.0, -2.0), _t(-6.0, -2.0, -7.0), _t(-3.0, -5.0, -4.0)
    lw, ll, beta = _t(2.0, 1.0, 3.0), _t(4.0, 5.0, 1.0), 0.7
    got = length_normalised_dpo_loss(cw, cl, rw, rl, beta, lw, ll)
    for i in range(3):
        h = (float(cw[i]) - float(rw[i])) / float(lw[i]) - (float(cl[i]) - float(rl[i])) / float(ll[i])
        assert float(got[i]) == pytest.approx(math.log(1 + math.exp(-beta * h)), rel=1e-12)
    # d loss / d log pi(y_w) = -(beta / |y_w|) sigmoid(-beta h): each token's pull shrinks with the length
    cw.requires_grad_(True)
    length_normalised_dpo_loss(cw, cl, rw, rl, beta, lw, ll).sum().backward()
    h = (cw.detach() - rw) / lw - (cl - rl) / ll
    assert torch.allclose(cw.grad, -(beta / lw) * torch.sigmoid(-beta * h))
    assert torch.autograd.gradcheck(lambda a, b: length_normalised_dpo_loss(a, b, rw, rl, beta, lw, ll),
                                    (cw.detach().clone().requires_grad_(True), cl.clone().requires_grad_(True)))


def test_equal_lengths_divide_beta_and_unit_lengths_are_dpo():
    gen = torch.Generator().manual_seed(0)
    cw, cl, rw, rl = (-4 * torch.rand(6, generator=gen, dtype=torch.float64) for _ in range(4))
    ones, fives = torch.ones(6), torch.full((6,), 5.0)
    assert torch.allclose(length_normalised_dpo_loss(cw, cl, rw, rl, 0.3, ones, ones), dpo_sigmoid_loss(cw, cl, rw, rl, 0.3))
    assert torch.allclose(length_normalised_dpo_loss(cw, cl, rw, rl, 1.5, fives, fives), dpo_sigmoid_loss(cw, cl, rw, rl, 0.3))
    # a zero length counts as one token (no division by zero)
    assert torch.allclose(length_normalised_dpo_loss(cw, cl, rw, rl, 0.3, torch.zeros(6), torch.zeros(6)),
                          dpo_sigmoid_loss(cw, cl, rw, rl, 0.3))


def test_preference_loss_and_the_trainers_objective_route_to_it():
    assert "sigmoid_norm" in DPO_LOSS_TYPES
    gen = torch.Generator().manual_seed(1)
    tok = -3 * torch.rand(2, 4, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    tok = torch.where(mask.bool(), tok, torch.nan)          # padding holds junk: it must not be read
    cw, cl = torch.where(mask.bool(), tok[0], 0).sum(-1), torch.where(mask.bool(), tok[1], 0).sum(-1)
    rw, rl = cw - 0.5, cl + 0.25
    lengths = mask.sum(-1)
    want = length_normalised_dpo_loss(cw, cl, rw, rl, 2.0, lengths, lengths).mean()
    got = preference_loss(cw, cl, rw, rl, beta=2.0, loss_type="sigmoid_norm", chosen_lengths=lengths,
                          rejected_lengths=lengths)
    assert torch.allclose(got, want)
    for per_token in (True, False):     # offline (TRL's DPOTrainer) and online (OnlineDPOTrainer) IPO conventions
        via_trainer = preference_objective(tok[0], tok[1], mask, mask, rw, rl, beta=2.0, loss_type="sigmoid_norm",
                                           ipo_per_token=per_token)
        assert torch.allclose(via_trainer, want)


def test_missing_lengths_are_named():
    a = _t(-1.0, -2.0)
    with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
        length_normalised_dpo_loss(a, a, a, a, 1.0, None, None)
    with pytest.raises(ValueError, match="sigmoid_norm"):
        preference_loss(a, a, a, a, beta=1.0, loss_type="sigmoid_norm")


def test_the_config_accepts_it_and_trl_reads_the_same_name(tmp_path):
    from trl import DPOConfig as TRLDPOConfig

    from rlcourse.interop.trl_bridge import dpo_config_kwargs
    from rlcourse.trainers.dpo import DPOConfig

    ours = DPOConfig(loss_type="sigmoid_norm", beta=5.0)
    theirs = TRLDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **dpo_config_kwargs(ours))
    assert theirs.loss_type == ["sigmoid_norm"]           # TRL's DPOConfig turns one name into a list
    assert theirs.beta == 5.0
