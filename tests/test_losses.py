import math

import torch

from fedmitr_core.losses import InversionLoss, TokenRelabelLoss, soft_kl, total_variation


def test_relabel_loss_on_a_hand_made_case():
    t = 2.0
    loss = TokenRelabelLoss(kd_weight=1.0, hi_weight=1.0, lo_weight=1.0, temperature=t)
    labels = torch.tensor([2])
    high = torch.tensor([[True, True, False, False]])
    low_target = torch.tensor([[0.7, 0.2, 0.1]])
    soft = torch.tensor([[0.1, 0.1, 0.8]])
    tok = torch.zeros(1, 4, 3)
    tok[0, :2, 2] = 50.0  # H tokens predict the label with certainty -> CE ~ 0
    tok[0, 2:] = t * low_target.log()  # L tokens reproduce q_L exactly -> KL = 0
    cls = t * soft.log()  # CLS reproduces p_E exactly -> KL = 0
    total, parts = loss(cls, tok, soft, labels, high, low_target)
    assert abs(parts["kd"]) < 1e-5 and abs(parts["hi"]) < 1e-5 and abs(parts["lo"]) < 1e-5
    assert float(total) < 1e-4

    # Swap the masks: H tokens now face q_L and L tokens face the label -> large loss.
    _, swapped = loss(cls, tok, soft, labels, ~high, low_target)
    assert swapped["hi"] > 1.0 and swapped["lo"] > 1.0


def test_relabel_loss_weights_and_plain_kd():
    cls = torch.randn(3, 5)
    tok = torch.randn(3, 4, 5)
    soft = torch.softmax(torch.randn(3, 5), dim=1)
    low = torch.softmax(torch.randn(3, 5), dim=1)
    labels = torch.tensor([0, 1, 2])
    high = torch.rand(3, 4) > 0.5
    kd_only = TokenRelabelLoss(1.0, 0.0, 0.0, 3.0)
    assert not kd_only.uses_tokens
    total, parts = kd_only(cls, tok, soft, labels, high, low)
    assert set(parts) == {"kd"}
    manual = (soft * (soft.log() - torch.log_softmax(cls / 3.0, 1))).sum(1).mean() * 9
    torch.testing.assert_close(total, manual)
    full = TokenRelabelLoss(1.0, 2.0, 3.0, 3.0)
    total2, p2 = full(cls, tok, soft, labels, high, low)
    torch.testing.assert_close(total2, torch.tensor(p2["kd"] + 2 * p2["hi"] + 3 * p2["lo"]),
                               atol=1e-4, rtol=1e-4)


def test_soft_kl_is_zero_for_matching_and_positive_otherwise():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    assert float(soft_kl(p.log(), p, 1.0)) < 1e-6
    assert float(soft_kl(torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]]), 1.0)) > 0.5


def test_total_variation_and_inversion_loss():
    flat = torch.zeros(1, 1, 4, 4)
    noisy = torch.randn(1, 1, 4, 4)
    assert float(total_variation(flat)) == 0.0 and float(total_variation(noisy)) > 0.0
    logits = torch.zeros(2, 1, 3)
    logits[0, 0, 1] = 10.0  # teacher 0 is sure of class 1, teacher 1 is uniform
    labels = torch.tensor([1])
    only_first = torch.tensor([[1.0], [0.0]])
    only_second = torch.tensor([[0.0], [1.0]])
    loss = InversionLoss(0.0, 0.0, "per-teacher")
    low, _ = loss(logits, torch.full((1, 3), 1 / 3), only_first, labels, flat)
    high, _ = loss(logits, torch.full((1, 3), 1 / 3), only_second, labels, flat)
    assert float(low) < 1e-3 and abs(float(high) - math.log(3)) < 1e-4
    mixture = InversionLoss(0.0, 0.0, "mixture")
    value, _ = mixture(logits, torch.tensor([[0.2, 0.6, 0.2]]), only_first, labels, flat)
    assert abs(float(value) + math.log(0.6)) < 1e-5
