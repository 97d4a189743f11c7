"""The student's losses: KD and token relabelling."""

import torch

from fedmitr_core.distill.losses import TokenRelabelLoss, soft_kl


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


def test_agreed_only_drops_the_h_term_of_images_the_ensemble_puts_elsewhere():
    labels = torch.tensor([1, 2])
    soft = torch.tensor([[0.1, 0.8, 0.1] + [0.0] * 7,   # agrees with label 1
                         [0.9, 0.05, 0.05] + [0.0] * 7])  # says 0, label is 2
    tok = torch.zeros(2, 4, 10)
    tok[0, :, 1] = 50.0  # image 0: H tokens sure of its label -> CE ~ 0
    tok[1, :, 0] = 50.0  # image 1: H tokens sure of class 0 -> CE ~ 50 against label 2
    high = torch.tensor([[True, True, False, False]] * 2)
    cls = torch.zeros(2, 10)
    plain = TokenRelabelLoss(1.0, 1.0, 0.0, 3.0)
    agreed = TokenRelabelLoss(1.0, 1.0, 0.0, 3.0, hi_agreed_only=True)
    _, p = plain(cls, tok, soft, labels, high, soft)
    _, a = agreed(cls, tok, soft, labels, high, soft)
    assert p["hi"] > 20.0  # image 1's H tokens count
    assert a["hi"] < 1e-3  # only image 0 counts
